"""dipaco.route.provenance: the routing fingerprint is the digest of the ids, hashed in bounded memory."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

import dipaco.route.provenance as provenance


def one_shot(paths: dict[str, np.ndarray], router_dir) -> str:
    """The fingerprint's definition, all at once."""
    digest = hashlib.sha256()
    for split in sorted(paths):
        digest.update(split.encode())
        digest.update(np.ascontiguousarray(paths[split], dtype=np.int64).tobytes())
    for file in sorted(router_dir.iterdir()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("rows", [1, 7, 1 << 20])
def test_the_fingerprint_in_chunks_is_the_digest_of_all_the_ids(tmp_path, monkeypatch, rows):
    monkeypatch.setattr(provenance, "FINGERPRINT_ROWS", rows)
    (tmp_path / "router.json").write_text('{"kind": "kmeans"}')
    rng = np.random.default_rng(0)
    paths = {"train": rng.integers(0, 16, 101).astype(np.int32), "validation": rng.integers(0, 16, 13),
             "train_topk": rng.integers(0, 16, (101, 2))}
    assert provenance.routing_fingerprint(paths, tmp_path) == one_shot(paths, tmp_path)
    changed = {**paths, "validation": paths["validation"][::-1].copy()}
    assert provenance.routing_fingerprint(changed, tmp_path) != one_shot(paths, tmp_path)


def test_the_fingerprint_holds_no_copy_of_the_ids(tmp_path):
    """It made an int64 copy of every split and its bytes at once: 16 bytes a document, 144 MB at 10M."""
    paths = {"train": np.arange(4_000_000, dtype=np.int32) % 4}
    tracemalloc.start()
    provenance.routing_fingerprint(paths, tmp_path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * 8 * provenance.FINGERPRINT_ROWS, peak  # 4M ids: 64 MB at once before
