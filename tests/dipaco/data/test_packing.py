
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dipaco.data.packing import (
    IGNORE_INDEX,
    batch_eval_windows,
    count_eval_windows,
    count_scored_tokens,
    eval_windows,
    pack_documents,
    unscored_docs,
)
from dipaco.errors import ConfigError, DataError

EOS, PAD = 0, 1


# ----------------------------------------------------------------------------- packing


def test_pack_layout_by_hand():
    docs = [[10, 11, 12], [20], [], [30, 31, 32, 33]]
    # stream: 10 11 12 E 20 E E 30 31 32 33 E  (12 tokens) -> 2 rows of 5, last 2 tokens dropped
    packed = pack_documents(docs, seq_len=5, eos_id=EOS)
    assert packed.dtype == torch.long
    assert packed.tolist() == [[10, 11, 12, EOS, 20], [EOS, EOS, 30, 31, 32]]


def test_pack_exact_fit_keeps_everything():
    packed = pack_documents([[1, 2, 3], [4, 5]], seq_len=7, eos_id=9)
    assert packed.tolist() == [[1, 2, 3, 9, 4, 5, 9]]


def test_pack_accepts_arrays_and_tensors():
    packed = pack_documents([np.array([5, 6]), torch.tensor([7])], seq_len=2, eos_id=EOS)
    assert packed.tolist() == [[5, 6], [EOS, 7]]


def test_pack_errors():
    with pytest.raises(DataError, match="no documents"):
        pack_documents([], seq_len=4, eos_id=EOS)
    with pytest.raises(DataError, match="shard has 5 tokens .* fewer than seq_len=8"):
        pack_documents([[1, 2], [3]], seq_len=8, eos_id=EOS)
    with pytest.raises(ConfigError):
        pack_documents([[1, 2]], seq_len=0, eos_id=EOS)


def test_pack_ten_million_tokens():
    # No wall-clock bound: a timed assertion failed on this shared 2-core machine under load.
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1000, size=20_000)
    docs = [list(range(n)) for n in lengths]  # lists of Python ints, as datasets returns them
    packed = pack_documents(docs, seq_len=512, eos_id=-1)
    total = int(lengths.sum()) + len(docs)
    assert packed.shape == (total // 512, 512)
    assert (packed == -1).sum() <= len(docs)
    flat = packed.flatten()
    ends = np.cumsum(lengths + 1) - 1  # position of each document's EOS in the stream
    ends = ends[ends < flat.numel()]
    assert (flat[ends] == -1).all()


# ----------------------------------------------------------------------------- eval windows


def scored_positions(windows, doc_index):
    """Doc positions of every non-ignored label of one document, one entry per occurrence."""
    positions = []
    for w in windows:
        if w.doc_index == doc_index:
            offsets = (w.labels != IGNORE_INDEX).nonzero().flatten() + w.start
            positions += offsets.tolist()
    return positions


@pytest.mark.parametrize("seq_len", [2, 3, 5, 8])
@pytest.mark.parametrize("prefix_tokens", [0, 1, 2, 4, 7, 20])
def test_each_scored_token_is_scored_exactly_once(seq_len, prefix_tokens):
    docs = [list(range(100, 100 + n)) for n in range(0, 24)]
    windows = eval_windows(docs, seq_len=seq_len, prefix_tokens=prefix_tokens)
    for i, doc in enumerate(docs):
        expected = [j for j in range(len(doc)) if j >= prefix_tokens and j >= 1]
        positions = scored_positions(windows, i)
        assert sorted(positions) == expected  # each scored index exactly once, nothing else
        assert len(positions) == count_scored_tokens(len(doc), prefix_tokens)
    for w in windows:
        assert 2 <= len(w.input_ids) <= seq_len
        assert w.input_ids.tolist() == docs[w.doc_index][w.start : w.start + len(w.input_ids)]
        scored = w.labels != IGNORE_INDEX
        assert scored.any() and not scored[0]  # a target always has its previous token in the window
        assert torch.equal(w.labels[scored], w.input_ids[scored])


def test_windows_overlap_by_exactly_one_token():
    windows = eval_windows([list(range(10))], seq_len=4, prefix_tokens=0)
    assert [(w.start, w.input_ids.tolist()) for w in windows] == [
        (0, [0, 1, 2, 3]),
        (3, [3, 4, 5, 6]),
        (6, [6, 7, 8, 9]),
    ]
    assert [w.labels.tolist() for w in windows] == [
        [IGNORE_INDEX, 1, 2, 3],
        [IGNORE_INDEX, 4, 5, 6],
        [IGNORE_INDEX, 7, 8, 9],
    ]


def test_prefix_zero_scores_all_but_the_first_token():
    (window,) = eval_windows([[5, 6, 7, 8]], seq_len=16, prefix_tokens=0)
    assert window.labels.tolist() == [IGNORE_INDEX, 6, 7, 8]
    assert count_scored_tokens(4, 0) == 3 and count_scored_tokens(1, 0) == 0 and count_scored_tokens(0, 0) == 0


def test_routing_prefix_is_never_scored():
    (window,) = eval_windows([[5, 6, 7, 8, 9]], seq_len=16, prefix_tokens=3)
    assert window.labels.tolist() == [IGNORE_INDEX] * 3 + [8, 9]
    assert window.input_ids.tolist() == [5, 6, 7, 8, 9]  # the prefix is still context


def test_docs_without_scored_tokens_get_no_windows():
    docs = [[1, 2, 3], [1, 2, 3, 4], [], [7]]
    windows = eval_windows(docs, seq_len=8, prefix_tokens=3)
    assert {w.doc_index for w in windows} == {1}
    assert unscored_docs(docs, prefix_tokens=3) == [0, 2, 3]
    assert unscored_docs(docs, prefix_tokens=0) == [2, 3]  # a one-token doc has nothing to predict


def test_long_prefix_skips_context_only_windows():
    # prefix 9 with seq_len 4: windows [0,4) and [3,7) would hold only context.
    windows = eval_windows([list(range(12))], seq_len=4, prefix_tokens=9)
    assert [w.start for w in windows] == [6, 9]
    assert scored_positions(windows, 0) == [9, 10, 11]


def test_eval_window_errors():
    with pytest.raises(ConfigError):
        eval_windows([[1, 2, 3]], seq_len=1, prefix_tokens=0)
    with pytest.raises(ConfigError):
        eval_windows([[1, 2, 3]], seq_len=4, prefix_tokens=-1)


# ----------------------------------------------------------------------------- batching


def test_batches_pad_right_to_the_longest_window():
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    windows = eval_windows(docs, seq_len=8, prefix_tokens=0)
    first, second = batch_eval_windows(windows, batch_size=2, pad_id=PAD)
    assert first.input_ids.tolist() == [[5, 6, 7], [8, 9, PAD]]
    assert first.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert first.labels.tolist() == [[IGNORE_INDEX, 6, 7], [IGNORE_INDEX, 9, IGNORE_INDEX]]
    assert first.doc_index.tolist() == [0, 1]
    assert second.input_ids.shape == (1, 4) and second.doc_index.tolist() == [2]


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def summed_nll(model, input_ids, attention_mask, labels):
    """Summed NLL over the scored targets of each row: a (B,) tensor."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    nll = F.cross_entropy(
        logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )  # (B, T-1), 0 where ignored
    return nll.sum(dim=1)


@pytest.mark.parametrize("prefix_tokens", [0, 3])
def test_windowed_loss_equals_whole_document_loss(prefix_tokens):
    model = tiny_llama()
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(2, 100, (n,), generator=generator).tolist() for n in (16, 5, 11, 2, 9)]
    seq_len = 16  # every doc fits in one window; batches mix lengths, so padding is exercised

    with torch.no_grad():
        per_doc = torch.zeros(len(docs))
        for batch in batch_eval_windows(eval_windows(docs, seq_len, prefix_tokens), batch_size=3, pad_id=PAD):
            nll = summed_nll(model, batch.input_ids, batch.attention_mask, batch.labels)
            per_doc.index_add_(0, batch.doc_index, nll)

        for i, doc in enumerate(docs):
            ids = torch.tensor([doc])
            labels = ids.clone()
            labels[:, : max(prefix_tokens, 1)] = IGNORE_INDEX
            whole = summed_nll(model, ids, torch.ones_like(ids), labels)[0]
            assert torch.allclose(per_doc[i], whole, atol=1e-4), (i, per_doc[i], whole)
            if count_scored_tokens(len(doc), prefix_tokens) == 0:
                assert per_doc[i] == 0


def test_batched_padded_loss_equals_per_window_loss():
    model = tiny_llama()
    docs = [list(range(2, 2 + n)) for n in (13, 4, 30, 7)]
    windows = eval_windows(docs, seq_len=12, prefix_tokens=2)
    with torch.no_grad():
        batched = torch.cat(
            [summed_nll(model, b.input_ids, b.attention_mask, b.labels) for b in batch_eval_windows(windows, 4, PAD)]
        )
        one_by_one = torch.cat(
            [summed_nll(model, w.input_ids[None], torch.ones_like(w.input_ids[None]), w.labels[None]) for w in windows]
        )
    assert torch.allclose(batched, one_by_one, atol=1e-4)


@pytest.mark.parametrize("seq_len,prefix_tokens", [(2, 0), (4, 9), (5, 1), (16, 3), (64, 32), (8, 40)])
def test_the_window_count_from_lengths_alone_is_len_of_eval_windows(seq_len, prefix_tokens):
    """`dipaco eval`'s progress bar counts windows from the lengths; it used to build every window of the
    validation split for that, all of its tokens in memory at once."""
    lengths = np.random.default_rng(seq_len + prefix_tokens).integers(0, 200, 300)
    lengths[:4] = [0, 1, prefix_tokens, prefix_tokens + 1]
    docs = [list(range(int(n))) for n in lengths]
    assert count_eval_windows(lengths, seq_len, prefix_tokens) == len(eval_windows(docs, seq_len, prefix_tokens))
