"""`dipaco export`: a path as a standalone Hugging Face model directory.

Every path is an ordinary dense ``LlamaForCausalLM``; exporting composes it from the bank of the
experiment's checkpoint and writes it with ``save_pretrained`` (safetensors) next to the run's
tokenizer, so ``AutoModelForCausalLM.from_pretrained(DIR, local_files_only=True)`` and
``AutoTokenizer.from_pretrained(DIR, local_files_only=True)`` load it with no dipaco installed.
``dipaco_path.json`` records where it came from::

    {"path": 3, "modules": ["embedding.0", "level0.1", "level1.1", "head.0"], "experiment": ...,
     "checkpoint": "round_000004", "run": ..., "topology": ..., "prefix_tokens": 32, ...}

``--all`` writes one such directory per path: ``OUT/path_000``, ``OUT/path_001``, ...

A path of a run started from an open model (``model.init_from``) keeps that checkpoint's special-token ids
(``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``unk_token_id``, as its config.json has them) in its
``config.json`` and ``generation_config.json``; where the checkpoint's config.json is no longer on the machine,
the BOS and UNK ids come from the run's tokenizer, which is the checkpoint's.
"""

from __future__ import annotations

import os
from pathlib import Path

from dipaco import json_text
from dipaco.atomic import replacing
from dipaco.errors import DipacoError
from dipaco.metrics import echo
from dipaco.model.llama import build_model
from dipaco.model.source import special_token_ids
from dipaco.serve.pipeline import LoadedExperiment, load_experiment

PATH_INFO = "dipaco_path.json"


def path_dir_name(path: int) -> str:
    return f"path_{path:03d}"


def export_path(loaded: LoadedExperiment, path: int, out: str | Path, model=None) -> Path:
    """Writes one path to ``out`` (replaced when it exists); returns ``out``.

    The directory is filled under a temporary name and renamed into place, so an interrupted
    export never leaves a half-written model under the real name.
    """
    loaded.check_path(path)
    out = Path(out)
    if out.exists() and not (out / PATH_INFO).is_file():
        raise DipacoError(f"{out} exists and is not a dipaco export; choose an empty or new directory")
    if out.exists():
        echo(f"[export] replacing the earlier export in {out}")
    model = model if model is not None else build_model(loaded.llama_config(use_cache=True), seed=0)
    loaded.bank.load_path(path, model)
    _keep_special_ids(model, loaded)
    with replacing(out) as tmp:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)  # safetensors by default
        loaded.tokenizer.save_pretrained(tmp)
        info = {
            "path": path,
            "modules": loaded.module_names(path),
            "path_digits": list(loaded.topology.path_digits(path)),
            "experiment": loaded.name,
            "checkpoint": loaded.checkpoint.name,
            "run": str(loaded.run.root.resolve()),
            "topology": loaded.topology.describe(),
            "num_paths": loaded.topology.num_paths,
            "sharding": loaded.spec.sharding.rule,
            "prefix_tokens": loaded.spec.prefix_tokens,
            "seq_len": loaded.spec.seq_len,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        (tmp / PATH_INFO).write_text(json_text.dumps(info, indent=2))
        _normal_file_modes(tmp)
    return out


def source_token_ids(loaded: LoadedExperiment) -> dict:
    """The special-token ids an export of ``loaded`` carries beyond its training config's (which has no BOS):
    those of the open model it started from, if any."""
    source = loaded.spec.model.get("init_from")
    if not source:
        return {}
    ids = special_token_ids(source)
    if ids is None:  # the checkpoint's config.json is gone; the run's tokenizer is the checkpoint's
        ids = {"bos_token_id": loaded.tokenizer.bos_token_id, "unk_token_id": loaded.tokenizer.unk_token_id}
    return ids


def _keep_special_ids(model, loaded: LoadedExperiment) -> None:
    """Sets the source's special-token ids on the model's config and generation config, which save_pretrained writes."""
    for key, value in source_token_ids(loaded).items():
        setattr(model.config, key, value)
        if key != "unk_token_id":  # a generation config has no UNK
            setattr(model.generation_config, key, value)


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_file_modes(directory: Path) -> None:
    """Gives every file of an export the mode a plain ``open(..., "w")`` would (0644 under umask 022).

    safetensors creates ``model.safetensors`` with mode 0600 whatever the umask: readable by nobody
    else, unlike the JSON files next to it and unlike what a model directory to share needs.
    """
    mode = 0o666 & ~_umask()
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def export(run_dir: str | Path, out: str | Path, path: int | None = None, all_paths: bool = False,
           experiment: str | None = None, checkpoint: str | None = None) -> list[Path]:
    """``dipaco export``: one path into ``out``, or every path into ``out/path_NNN``."""
    if (path is None) == (not all_paths):
        raise DipacoError("export: give either --path P or --all")
    loaded = load_experiment(run_dir, experiment, checkpoint)
    if path is not None:
        loaded.check_path(path)
    out = Path(out)
    model = build_model(loaded.llama_config(use_cache=True), seed=0)  # reused: each path overwrites it
    targets = ([(p, out / path_dir_name(p)) for p in range(loaded.topology.num_paths)] if path is None
               else [(path, out)])
    written = []
    for p, target in targets:
        written.append(export_path(loaded, p, target, model))
        echo(f"[export] path {p} ({' '.join(loaded.module_names(p))}) -> {target}")
    echo(f"[export] {loaded.name} {loaded.checkpoint.name}: {len(written)} path(s); load with "
         f"AutoModelForCausalLM.from_pretrained(DIR, local_files_only=True)")
    return written
