"""The decoding loop on the tiny run's paths: a batch gives every row what it gets alone, each row ends on
its own, and a cancelled row leaves the others untouched."""

import math

import pytest
import torch
from transformers.generation import LogitsProcessor, LogitsProcessorList

from dipaco.errors import DipacoError
from dipaco.serve.decode import DecodeRow, decode_batch, left_padded, sampling_processors
from dipaco.serve.pipeline import Pipeline

PROMPTS = [
    "The government said on Tuesday that the economy grew faster than expected in the last quarter",
    "The striker scored",
    "Shares in the bank rose after the results",
    "In the beginning of the war the army",
    "The film won three awards",
    "Researchers found that the new drug cut the risk of a second heart attack by half",
]


@pytest.fixture(scope="module")
def pipe(served_run) -> Pipeline:
    return Pipeline.from_run(served_run.run.dir, cache_size=4)


def model(pipe, path: int = 0):
    return pipe.cache.get(path).model


def rows_for(pipe, prompts, **kwargs) -> list[DecodeRow]:
    return [pipe.plan(p, path=0, **kwargs).row for p in prompts]


def decode(pipe, rows) -> list[DecodeRow]:
    decode_batch(model(pipe), rows, pipe.tokenizer.eos_token_id, pipe.tokenizer.pad_token_id)
    return rows


def alone(pipe, row: DecodeRow) -> list[int]:
    fresh = DecodeRow(row.prompt_ids, row.max_new_tokens, min_new_tokens=row.min_new_tokens)
    return decode(pipe, [fresh])[0].tokens


class ForceEos(LogitsProcessor):
    """Makes EOS the only choice once ``after`` tokens exist (a row that stops early, by EOS)."""

    def __init__(self, eos: int, prompt_len: int, after: int) -> None:
        self.eos, self.prompt_len, self.after = eos, prompt_len, after

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len >= self.after:
            scores = torch.full_like(scores, -math.inf)
            scores[:, self.eos] = 0.0
        return scores


def test_left_padding_aligns_the_last_prompt_tokens_and_counts_positions_per_row():
    rows = [DecodeRow([5, 6, 7], 1), DecodeRow([8], 1)]
    ids, mask, positions = left_padded(rows, pad_token_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_greedy_rows_of_a_batch_equal_the_rows_alone(pipe):
    rows = rows_for(pipe, PROMPTS, max_new_tokens=16, min_new_tokens=16)
    assert len({len(r.prompt_ids) for r in rows}) > 3  # the batch is left-padded
    expected = [alone(pipe, r) for r in rows]
    decode(pipe, rows)
    assert [r.tokens for r in rows] == expected
    assert all(r.batch_size == len(PROMPTS) and r.finish_reason == "length" for r in rows)


def test_rows_end_at_their_own_lengths_and_are_reported_as_they_end(pipe):
    """max_new_tokens of 2, 5 and 12, and a row that stops at EOS after 3 tokens: each row is reported
    when it ends, while the longer ones are still decoding, with what it gets alone."""
    eos = pipe.tokenizer.eos_token_id
    rows = rows_for(pipe, PROMPTS[:4], max_new_tokens=12, min_new_tokens=12)
    rows[0].max_new_tokens = rows[0].min_new_tokens = 2
    rows[1].max_new_tokens = rows[1].min_new_tokens = 5
    rows[3].processors = LogitsProcessorList([ForceEos(eos, len(rows[3].prompt_ids), after=3)])
    progress_at_finish = {}
    for i, row in enumerate(rows):
        row.on_finish = lambda r, i=i: progress_at_finish.setdefault(i, len(rows[2].tokens))
    expected = [alone(pipe, r) for r in rows[:3]]
    decode(pipe, rows)
    assert [len(r.tokens) for r in rows] == [2, 5, 12, 4]
    assert [r.finish_reason for r in rows] == ["length", "length", "length", "stop"]
    assert rows[3].tokens[-1] == eos
    assert [r.tokens for r in rows[:3]] == expected  # the rows that ended did not change the others
    # Each row was reported in the step it ended, while the longest row (decoded after rows 0 and 1 in a
    # step, before row 3) was still running.
    assert progress_at_finish == {0: 1, 1: 4, 3: 4, 2: 12}


def test_a_row_cancelled_mid_batch_stops_and_the_others_are_unchanged(pipe):
    rows = rows_for(pipe, PROMPTS[:3], max_new_tokens=10, min_new_tokens=10)
    expected = [alone(pipe, r) for r in rows]

    class CancelRowOne(LogitsProcessor):  # the client of row 1 disconnects after 3 of row 0's steps
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - len(rows[0].prompt_ids) == 3:
                rows[1].cancel()
            return scores

    greedy_with_a_hook = LogitsProcessorList([CancelRowOne()])
    rows[0].processors = greedy_with_a_hook  # no sampler: the argmax of the unchanged scores, i.e. greedy
    decode(pipe, rows)
    assert rows[1].finish_reason == "cancelled" and len(rows[1].tokens) == 4
    assert rows[1].tokens == expected[1][:4]
    assert [rows[0].tokens, rows[2].tokens] == [expected[0], expected[2]]
    assert rows[0].finish_reason == rows[2].finish_reason == "length"


@pytest.mark.parametrize("first,later", [(PROMPTS[1:3], PROMPTS[3:6]), (PROMPTS[3:6], PROMPTS[:2])])
def test_rows_that_join_a_running_batch_decode_as_alone(pipe, first, later):
    """Rows admitted between steps (shorter or longer prompts than the running ones: either cache is
    left-padded to the other) give the tokens they give alone, and so do the rows they join."""
    rows = rows_for(pipe, first, max_new_tokens=10, min_new_tokens=10)
    joiners = rows_for(pipe, later, max_new_tokens=6, min_new_tokens=6)
    expected = [alone(pipe, r) for r in rows + joiners]
    offers = {2: joiners[:2], 4: joiners[2:]}  # after the 2nd and the 4th step
    steps = []

    def admit(decoding: int) -> list[DecodeRow]:
        return offers.pop(len(rows[0].tokens), [])

    decode_batch(model(pipe), rows, pipe.tokenizer.eos_token_id, pipe.tokenizer.pad_token_id, admit=admit,
                 on_step=steps.append)
    assert [r.tokens for r in rows + joiners] == expected
    assert all(r.finish_reason == "length" for r in rows + joiners)
    assert joiners[0].batch_size == len(first) + 2 and steps[0] == len(first)
    assert max(steps) == len(first) + len(later)  # they decoded together


def test_a_row_cancelled_before_its_batch_never_runs(pipe):
    rows = rows_for(pipe, PROMPTS[:2], max_new_tokens=4)
    rows[0].cancel()
    decode(pipe, rows)
    assert rows[0].tokens == [] and rows[0].finish_reason == "cancelled"
    assert rows[1].batch_size == 1 and len(rows[1].tokens) >= 1


def test_seeded_rows_sample_the_same_batched_and_alone(pipe):
    """Each row has its own temperature, top-k, top-p and generator; one greedy row rides along."""
    settings = [(0.7, 1.0, 0, 1), (1.0, 0.9, 0, 2), (1.3, 1.0, 20, 3), (0.0, 1.0, 0, None), (1.0, 1.0, 0, 1)]

    def build():
        out = []
        for prompt, (temperature, top_p, top_k, seed) in zip(PROMPTS, settings):
            out.append(pipe.plan(prompt, path=0, max_new_tokens=12, min_new_tokens=12, temperature=temperature,
                                 top_p=top_p, top_k=top_k, seed=seed).row)
        return out

    batched = decode(pipe, build())
    lone = [decode(pipe, [r])[0] for r in build()]
    assert [r.tokens for r in batched] == [r.tokens for r in lone]
    assert batched[0].tokens != batched[4].tokens  # the same seed on another prompt: its own draws


def test_a_lone_row_is_hf_generate_for_sampling_too(pipe):
    """Seeded sampling through the loop equals HF generate with the same processors (one row)."""
    row = pipe.plan(PROMPTS[1], path=0, max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=11).row
    decode(pipe, [row])
    ids = torch.tensor([row.prompt_ids])
    out = model(pipe).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                               logits_processor=sampling_processors(0.9, 0.95, 40, 11, "cpu"),
                               pad_token_id=pipe.tokenizer.pad_token_id, eos_token_id=pipe.tokenizer.eos_token_id)
    assert row.tokens == out[0, ids.shape[1]:].tolist()


def test_a_row_needs_a_prompt_and_a_token_to_generate():
    with pytest.raises(DipacoError, match="empty"):
        DecodeRow([], 4)
    with pytest.raises(DipacoError, match="max_new_tokens"):
        DecodeRow([1], 0)
