"""The 4-bit codecs (int4, fp4 = E2M1) and adaptive codec choice: round trips, error feedback, state."""

import pytest
import torch

from dipaco.comm.adaptive import CANDIDATES, choose, relative_error, sample_chunks
from dipaco.comm.codecs import E2M1_VALUES, build_codec, pack_nibbles, unpack_nibbles


def test_nibbles_pack_two_per_byte_and_back():
    codes = torch.tensor([0, 15, 7, 8, 3])
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0 | 15 << 4, 7 | 8 << 4, 3]
    assert unpack_nibbles(packed, 5).tolist() == codes.tolist()


def test_fp4_is_e2m1_and_represents_its_grid_exactly():
    codec = build_codec("fp4", chunk=16)
    grid = torch.cat([E2M1_VALUES, -E2M1_VALUES[1:]])  # absmax 6: scale 1, every value on the grid
    x = torch.cat([grid, torch.zeros(16 - grid.numel())])
    assert torch.equal(codec.encode(x).decoded, x)
    # round to nearest on the grid: 2.4 -> 2, 2.6 -> 3, 5.1 -> 6 (scale 1: absmax 6 in the chunk)
    y = torch.tensor([2.4, 2.6, 5.1, -0.2, 6.0, 0.0, 0.0, 0.0])
    assert codec.encode(y).decoded.tolist() == [2.0, 3.0, 6.0, -0.0, 6.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("name,bound", [("int4", 1 / 14), ("fp4", 1 / 6)])
def test_4bit_round_trip_is_within_its_bound_per_chunk_and_decodes_from_bytes(name, bound):
    codec = build_codec(name, chunk=32)
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))  # odd length: a half-used last byte
    enc = codec.encode(x)
    assert enc.payload.numel() == codec.payload_bytes(1001) == 501
    assert enc.scale.numel() == codec.scale_bytes(1001) == 4 * 32
    assert torch.equal(codec.decode(enc.scale, enc.payload, 1001), enc.decoded)  # the bytes say it all
    chunks = torch.nn.functional.pad(x, (0, 31 * 32 + 32 - 1001)).view(-1, 32)
    absmax = chunks.abs().amax(dim=1).repeat_interleave(32)[:1001]
    assert torch.all((x - enc.decoded).abs() <= absmax * bound + 1e-6)


@pytest.mark.parametrize("name", ["int4", "fp4"])
def test_error_feedback_carries_the_residual_and_the_sum_converges(name):
    """Sending x every round: with the residual carried, sum of what was sent = K x - final residual,
    so the mean converges to x at rate 1/K; without it the same bias is lost every round."""
    codec = build_codec(name, chunk=16)
    x = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 0.1
    x[:4] += 0.033  # values between grid points
    residual = torch.zeros_like(x)
    sent_ef, sent_plain = torch.zeros_like(x), torch.zeros_like(x)
    errors = []
    for k in range(1, 41):
        carried = x + residual
        decoded = codec.encode(carried).decoded
        residual = carried - decoded  # what this send lost, carried into the next one
        sent_ef += decoded
        sent_plain += codec.encode(x).decoded
        torch.testing.assert_close(sent_ef + residual, k * x, rtol=0, atol=1e-5)  # nothing is ever lost
        errors.append(float((sent_ef / k - x).abs().max()))
    plain_error = float((sent_plain / 40 - x).abs().max())
    assert errors[-1] < errors[0] / 10  # the mean converges to x
    assert errors[-1] < plain_error / 5  # while plain quantization keeps its bias
    assert float(residual.abs().max()) <= float(x.abs().max()) * 2  # and the residual stays bounded


def test_adaptive_picks_the_cheapest_codec_within_the_tolerance():
    codecs = [build_codec(n, 64) for n in CANDIDATES]
    gen = torch.Generator().manual_seed(0)
    gaussian = torch.randn(4096, generator=gen)  # 4-bit relative error ~0.11
    with torch.random.fork_rng():  # StudentT samples from the global generator: seed it, or the draw (and the
        torch.manual_seed(0)  # chosen codec) depends on which tests ran before
        heavy = torch.distributions.StudentT(2.0).sample((4096,))  # heavy tails: chunk scales waste the 4-bit grid
    i, errors = choose(codecs, gaussian, tolerance=0.12)
    assert CANDIDATES[i] == "fp4" and errors[0] < errors[1] and errors[i] <= 0.12  # same size: smaller error
    j, errors = choose(codecs, heavy, tolerance=0.12)
    assert CANDIDATES[j] == "int8" and min(errors[0], errors[1]) > 0.12 >= errors[j]
    k, _ = choose(codecs, heavy, tolerance=0.0)  # nothing is exact: the most precise candidate
    assert CANDIDATES[k] == "bf16"


def test_adaptive_error_is_measured_on_evenly_spaced_whole_chunks():
    values = torch.arange(10 * 4, dtype=torch.float32) + 1  # 10 chunks of 4; chunk i holds 4i+1 .. 4i+4
    picked = sample_chunks(values, 4, 4)  # chunks 0, 3, 6, 9 (linspace over 0..9, rounded)
    assert picked.view(-1, 4)[:, 0].tolist() == [1.0, 13.0, 25.0, 37.0]
    assert torch.equal(sample_chunks(values, 4, 0), values)  # 0: every chunk
    assert torch.equal(sample_chunks(values, 4, 10), values)  # no more chunks than the sample
    ragged = sample_chunks(values[:-2], 4, 2)  # the last chunk is zero-padded, as the codecs pad it
    assert ragged.tolist() == [1.0, 2.0, 3.0, 4.0, 37.0, 38.0, 0.0, 0.0]


def test_adaptive_sampled_choice_matches_the_full_one_and_scales_each_chunk_alone():
    codecs = [build_codec(n, 64) for n in CANDIDATES]
    gen = torch.Generator().manual_seed(0)
    gaussian = torch.randn(64 * 512, generator=gen)
    full, full_errors = choose(codecs, gaussian, tolerance=0.12, chunk=64, sample=0)
    sampled, sampled_errors = choose(codecs, gaussian, tolerance=0.12, chunk=64, sample=32)
    assert sampled == full and CANDIDATES[full] == "fp4"
    torch.testing.assert_close(torch.tensor(sampled_errors), torch.tensor(full_errors), rtol=0.1, atol=1e-4)
    # A sampled chunk is encoded exactly as in a real sync: its error is that chunk's own error.
    one = sample_chunks(gaussian, 64, 1)  # chunk 0 only
    assert relative_error(codecs[0], one) == relative_error(codecs[0], gaussian[:64])


def test_adaptive_sample_chunks_must_not_be_negative():
    from dipaco.errors import ConfigError
    from dipaco.run import load_config

    with pytest.raises(ConfigError, match="dist.adaptive_sample_chunks: must be >= 0"):
        load_config(None, ["dist.comm_dtype=int8", "dist.adaptive=true", "dist.adaptive_sample_chunks=-1"])
