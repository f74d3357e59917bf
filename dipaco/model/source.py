"""Starting from an open model: a Llama-architecture checkpoint as the run's dense init, tokenizer and shape.

``model.init_from=SOURCE`` names a local HF directory or a hub name (``HuggingFaceTB/SmolLM2-135M``). Hub names
go through the hub's own download and cache (``huggingface_hub.snapshot_download``), so every later job finds
them there; a local directory is read in place. What it gives the run:

* **Shape.** Every ``model.*`` key that changes the math (:data:`dipaco.config.SHAPE_KEYS`) is read from the
  checkpoint's ``config.json`` by :func:`resolve_init_from`, when the config is loaded. A key the config leaves
  unset takes the checkpoint's value; one it sets to another value is an error naming both. Nothing is ever
  silently overridden.
* **Tokenizer.** The checkpoint's own (``tokenizer.path`` defaults to SOURCE; no BPE is trained). One without a
  pad token pads with its EOS token: no id changes and the embedding never grows. The model config then has no
  ``pad_token_id``, so no embedding row is frozen (``nn.Embedding``'s ``padding_idx`` would freeze EOS's).
* **Weights.** ``dipaco pretrain`` copies them into the dense model (:func:`import_weights`), one tensor at a
  time from the memory-mapped safetensors files, so importing holds at most one tensor beyond the model itself.
  A sharded checkpoint (``model.safetensors.index.json``) works; pickled ``.bin`` weights are refused, since
  unpickling runs arbitrary code.

A hostile or damaged checkpoint is one error naming the file and the field or tensor, before anything is
written or built: every field transformers refuses in ``config.json``, a RoPE type or parameters it cannot
compute (:func:`check_rope`), tensor shapes that are not the ones ``config.json`` implies (read from the
safetensors headers, no tensor loaded: :func:`check_weight_shapes`), more parameters than the machine's
available memory holds (:func:`check_memory`), and non-finite weights (at import). Hub requests that
huggingface_hub sends without a timeout get ``HF_HUB_ETAG_TIMEOUT`` (:func:`source_dir`), so a hub that
never answers is an error instead of a hang.

Supported: ``model_type`` ``llama`` (Llama 2 and 3.x, SmolLM/SmolLM2, TinyLlama), whose math ``LlamaForCausalLM``
is; any other architecture is refused with one error naming it.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from transformers import LlamaConfig, PreTrainedModel

from dipaco.config import SHAPE_KEYS, ModelConfig, TokenizerConfig
from dipaco.errors import CheckpointError, ConfigError

SUPPORTED = {"llama": "Llama 2 and 3.x, SmolLM/SmolLM2, TinyLlama"}
WEIGHTS, SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"
CONFIG_FILES = ("config.json",)
WEIGHT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")
PICKLED = (".bin", ".pt", ".pth", ".ckpt")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
# config.json's fields the shape is read from, checked before transformers reads them (its own errors do not
# always name the field)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim")
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_ROPE_FIELDS = ("rope_parameters", "rope_scaling")  # transformers 5's name, and 4.x's
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
FP32_BYTES = 4  # a parameter of the path model: fp32 master weights
TRAINING_BYTES = 16  # and its gradient and AdamW's two moments, fp32 each


def source_dir(source: str, files: Sequence[str] = CONFIG_FILES) -> Path:
    """The local directory of ``source``: the directory itself, or the hub cache's snapshot of ``files`` (glob
    patterns) of the hub model of that name."""
    local = Path(source).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not _HUB_NAME.match(source):
        raise ConfigError(f"model.init_from: {source} is not a checkpoint directory (nor a hub name like org/model)")
    try:
        from huggingface_hub import snapshot_download

        _hub_requests_time_out()
        return Path(snapshot_download(source, allow_patterns=list(files)))
    except Exception as exc:  # offline, unknown repo, gated model: the hub's own exception types
        if _timed_out(exc):
            from huggingface_hub import constants

            raise ConfigError(f"model.init_from: the hub at {constants.ENDPOINT} did not answer for {source} "
                              f"(HF_HUB_ETAG_TIMEOUT={constants.HF_HUB_ETAG_TIMEOUT:g} s for a request, "
                              f"HF_HUB_DOWNLOAD_TIMEOUT={constants.HF_HUB_DOWNLOAD_TIMEOUT:g} s for a file's bytes; "
                              f"raise them for a slow connection, or pass a local directory)") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.init_from: {source} is not a local directory, and the hub did not give it ({first}); "
                          f"download it once (huggingface-cli download {source}) or pass its local directory") from None


def _with_a_timeout(request: Any) -> None:
    """An httpx request hook: a request huggingface_hub sends with no timeout (its repo_info and tree listing
    calls) gets HF_HUB_ETAG_TIMEOUT for each phase, so a hub that accepts the connection and never answers fails
    instead of hanging. A timeout the hub chose itself stays."""
    from huggingface_hub import constants

    timeout = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {phase: constants.HF_HUB_ETAG_TIMEOUT if timeout.get(phase) is None
                                     else timeout[phase] for phase in ("connect", "read", "write", "pool")}


def _hub_requests_time_out() -> None:
    """Adds :func:`_with_a_timeout` to huggingface_hub's shared HTTP client (an httpx client since
    huggingface_hub 1.0; an older one's requests session has no hooks, and keeps its own behaviour)."""
    from huggingface_hub import get_session

    hooks = getattr(get_session(), "event_hooks", None)
    if isinstance(hooks, dict) and _with_a_timeout not in hooks.setdefault("request", []):
        hooks["request"].append(_with_a_timeout)


def _timed_out(exc: BaseException) -> bool:
    """Whether a timeout is behind ``exc`` (the hub wraps its transport's timeout in its own errors)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, TimeoutError) or any(c.__name__ == "TimeoutException" for c in type(cause).__mro__):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def source_config(directory: Path) -> LlamaConfig:
    """The checkpoint's config, refused unless its ``model_type`` is a supported Llama."""
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.init_from: {directory} has no config.json (not a HF model directory)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable model config ({exc})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED:
        supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
        raise ConfigError(f"model.init_from: {directory} is a {model_type!r} model; supported model_type: {supported}")
    _check_fields(raw, path)
    try:
        config = LlamaConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers' validation: its own, huggingface_hub's strict dataclasses, KeyError
        raise ConfigError(f"{path}: {_refusal(exc)}") from None
    if config.hidden_act != "silu":
        raise ConfigError(f"model.init_from: {directory} uses hidden_act={config.hidden_act!r}; a Llama path uses silu")
    return config


def _check_fields(raw: dict[str, Any], path: Path) -> None:
    """The fields of config.json the path's shape is read from: each of its type and range, named."""
    def refuse(key: str, want: str) -> ConfigError:
        return ConfigError(f"{path}: {key} must be {want}, got {raw[key]!r}")

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    for key in _POSITIVE_INTS:
        if key in raw and not integer(raw[key]):
            raise refuse(key, "an integer > 0")
    for key in _OPTIONAL_INTS:
        if raw.get(key) is not None and not integer(raw[key]):
            raise refuse(key, "an integer > 0 or null")
    for key in _POSITIVE_NUMBERS:
        value = raw.get(key)
        if key in raw and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                               and math.isfinite(value) and value > 0):
            raise refuse(key, "a finite number > 0")
    for key in _BOOLS:
        if key in raw and not isinstance(raw[key], bool):
            raise refuse(key, "true or false")
    for key in _ROPE_FIELDS:
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise refuse(key, "a mapping (rope_type and its parameters) or null")
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if hidden is not None and heads is not None and hidden % heads:
        raise ConfigError(f"{path}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    kv_heads = raw.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ConfigError(f"{path}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")


def _refusal(exc: BaseException) -> str:
    """transformers' refusal of a config as one line that starts with the field it names."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()] or [type(exc).__name__]
    named = re.search(r"(?:field|validator) '(\w+)'|`(\w+)`", lines[0])
    if named and len(lines) > 1 and lines[0].endswith(":"):  # "Validation error for field 'x':" over its cause
        lines = [re.sub(r"^\w+(Error|Exception): ", "", lines[1]), *lines[2:]]
    message = " ".join(lines)
    return f"{named[1] or named[2]}: {message}" if named else message


def rope_types() -> list[str]:
    """The RoPE types this transformers computes."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return sorted({"default", *ROPE_INIT_FUNCTIONS})


def check_rope(model: ModelConfig, where: str) -> None:
    """Computes the path model's RoPE frequencies as ``build_model`` will, so that an unknown type or
    parameters its formula cannot use (missing, not numbers, dividing by zero) are one error naming ``where``
    when the config is loaded, not a traceback when the model is built. Shapes too broken to have a RoPE are
    left to :func:`dipaco.model.llama.check_model`."""
    scaling = model.rope_scaling
    if scaling is None:
        return  # plain RoPE
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if not isinstance(rope_type, str):
        return  # check_model says a rope_type is missing
    if rope_type not in rope_types():
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not one transformers {transformers.__version__} "
                          f"computes ({', '.join(rope_types())})")
    heads = model.num_heads
    head_dim = model.head_dim or (model.hidden_size // heads if heads > 0 and model.hidden_size % heads == 0 else 0)
    if head_dim <= 0:
        return
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    try:  # only what the frequencies depend on; data.seq_len, the default of max_positions, is not known here
        config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim,
                             max_position_embeddings=model.max_positions or 2 * head_dim, rope_theta=model.rope_theta,
                             rope_scaling=dict(scaling))
        inv_freq = LlamaRotaryEmbedding(config).inv_freq
    except Exception as exc:  # the RoPE formulas' own errors: KeyError, TypeError, ZeroDivisionError, ...
        raise ConfigError(f"{where}: RoPE {rope_type} with {dict(scaling)} cannot be computed ({_refusal(exc)})") from None
    if not bool(torch.isfinite(inv_freq).all()):
        raise ConfigError(f"{where}: RoPE {rope_type} with {dict(scaling)} gives non-finite frequencies")


def _rope(config: LlamaConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the scaling parameters or None) of a config: transformers 5 keeps both in ``rope_parameters``,
    4.x in ``rope_theta`` and ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if params:
        scaling = {k: v for k, v in dict(params).items() if k != "rope_theta"}
        theta = params["rope_theta"]
    else:
        scaling, theta = dict(getattr(config, "rope_scaling", None) or {}), config.rope_theta
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return float(theta), None
    return float(theta), scaling


def checkpoint_shape(config: LlamaConfig) -> dict[str, Any]:
    """The ``model.*`` values (every key of :data:`SHAPE_KEYS`) of a checkpoint's config."""
    theta, scaling = _rope(config)
    heads = config.num_attention_heads
    shape = {
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_heads": heads,
        "num_kv_heads": config.num_key_value_heads or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "vocab_size": config.vocab_size, "max_positions": config.max_position_embeddings,
        "tie_embeddings": bool(config.tie_word_embeddings), "rope_theta": theta, "rope_scaling": scaling,
        "rms_norm_eps": float(config.rms_norm_eps), "attention_bias": bool(config.attention_bias),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
    }
    assert set(shape) == set(SHAPE_KEYS)
    return shape


def _same(mine: Any, theirs: Any) -> bool:
    if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(mine, bool):
        return math.isclose(float(mine), float(theirs), rel_tol=1e-12, abs_tol=0.0)
    return bool(mine == theirs)


def resolve_init_from(model: ModelConfig, tokenizer: TokenizerConfig,
                      given: set[str]) -> tuple[ModelConfig, TokenizerConfig]:
    """The ``model`` and ``tokenizer`` sections with ``model.init_from``'s shape and tokenizer filled in.

    ``given``: the ``model`` keys the config file or the command line set. A given shape key whose value is not
    the checkpoint's is an error naming both; a local checkpoint's weights are checked to be readable safetensors
    here, before any job writes anything: their tensors' shapes against the ones config.json implies.

    Without ``init_from``, ``model.rope_scaling`` is checked (:func:`check_rope`) as a checkpoint's would be."""
    if model.init_from is None:
        check_rope(model, "model.rope_scaling")
        return model, tokenizer
    source = model.init_from
    if not source.strip():
        raise ConfigError("model.init_from: empty; give a checkpoint directory or a hub name (org/model), or null")
    directory = source_dir(source)
    shape = checkpoint_shape(source_config(directory))
    resolved = replace(model, **shape)
    check_rope(resolved, f"{directory / 'config.json'}: rope_parameters")
    differ = [f"model.{key}={getattr(model, key)!r} but the checkpoint has {value!r}" for key, value in shape.items()
              if key in given and getattr(model, key) is not None and not _same(getattr(model, key), value)]
    if differ:
        raise ConfigError(f"model.init_from={source}: the config contradicts the checkpoint: {'; '.join(differ)}. "
                          f"Leave these keys unset: they take the checkpoint's values")
    if tokenizer.path is not None and tokenizer.path != source:
        raise ConfigError(f"tokenizer.path: {tokenizer.path} given with model.init_from={source}; the run uses the "
                          f"checkpoint's own tokenizer (leave tokenizer.path unset)")
    if Path(source).expanduser().is_dir():
        check_weight_shapes(directory, resolved)  # a hub model's weights are fetched (and checked) by `dipaco pretrain`
    return resolved, replace(tokenizer, path=source)


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files, each checked to be whole (its header read): ``model.safetensors``,
    or the shards its index lists. Pickled weights alone are refused."""
    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif (directory / SHARD_INDEX).is_file():
        index = directory / SHARD_INDEX
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a readable shard index ({exc})") from None
        files = [directory / Path(name).name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {', '.join(missing)}, missing from {directory}")
    else:
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLED)
        if pickled:
            raise CheckpointError(f"{directory}: only pickled weights ({', '.join(pickled)}); dipaco never unpickles "
                                  f"weights, since loading a pickle can run arbitrary code. Convert them once with "
                                  f"transformers (from_pretrained, then save_pretrained, which writes safetensors)")
        raise CheckpointError(f"{directory}: no {WEIGHTS} and no {SHARD_INDEX}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # safetensors' own error type: a truncated file's header does not cover it
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    return files


def expected_shapes(model: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The tensors ``LlamaForCausalLM`` has for a resolved ``model`` section: (those outside the decoder blocks,
    by name; those of every block, by their name inside it), with their shapes."""
    hidden, inner, vocab = model.hidden_size, model.intermediate_size, model.vocab_size or 0
    heads = model.num_heads
    kv_heads, head_dim = model.num_kv_heads or heads, model.head_dim or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    outside = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not model.tie_embeddings:
        outside["lm_head.weight"] = (vocab, hidden)
    block = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
             "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
             "mlp.down_proj.weight": (hidden, inner), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    if model.attention_bias:
        block |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                  "self_attn.o_proj.bias": (hidden,)}
    if model.mlp_bias:
        block |= {"mlp.gate_proj.bias": (inner,), "mlp.up_proj.bias": (inner,), "mlp.down_proj.bias": (hidden,)}
    return outside, block


def check_weight_shapes(directory: Path, model: ModelConfig) -> int:
    """Checks every tensor of the checkpoint in ``directory`` against the shape its config.json implies
    (``model``: the section resolved from it), reading the safetensors headers alone: no tensor is loaded, so a
    config.json that claims a billion-row embedding or 100,000 layers costs nothing. Returns the parameters the
    tensors hold."""
    config = directory / "config.json"
    outside, block = expected_shapes(model)
    seen: set[str] = set()
    layers: dict[int, set[str]] = defaultdict(set)
    params = 0
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if _skipped(name, model.tie_embeddings):
                    continue
                shape = tuple(tensors.get_slice(name).get_shape())
                in_block = _BLOCK.fullmatch(name)
                if in_block and int(in_block[1]) >= model.num_layers:
                    raise CheckpointError(f"{file}: {name} is in decoder layer {in_block[1]}, but {config} has "
                                          f"num_hidden_layers={model.num_layers}")
                want = block.get(in_block[2]) if in_block else outside.get(name)
                if want is None:
                    raise CheckpointError(f"{file}: {name} is not a parameter of the Llama path model")
                if shape != want:
                    raise CheckpointError(f"{file}: {name} has shape {shape} in the file; {config} implies {want}")
                if in_block:
                    layers[int(in_block[1])].add(in_block[2])
                else:
                    seen.add(name)
                params += math.prod(shape)
    if len(layers) < model.num_layers:
        raise CheckpointError(f"{config} has num_hidden_layers={model.num_layers}, but the weights in {directory} "
                              f"hold {len(layers)} decoder layers")
    missing = [name for name in outside if name not in seen]
    missing += [f"model.layers.{i}.{part}" for i in sorted(layers) for part in block if part not in layers[i]]
    if missing:
        raise CheckpointError(f"{directory}: the weights lack {len(missing)} tensors {config} implies, e.g. "
                              f"{', '.join(missing[:3])}")
    return params


def available_memory() -> int | None:
    """The bytes of memory available to a new allocation (MemAvailable in /proc/meminfo); None where that
    cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(params: int, training: bool, source: str) -> None:
    """Refuses a checkpoint whose parameters need more memory than the machine has available: the path model is
    built on the CPU in fp32 first, and training on the CPU adds gradients and AdamW's two moments. A lower
    bound (activations come on top), so it refuses only what cannot work."""
    have = available_memory()
    per_param = TRAINING_BYTES if training else FP32_BYTES
    if have is None or params * per_param <= have:
        return
    what = "to train (fp32 weights, gradients and AdamW's two moments)" if training else "for their fp32 weights"
    raise CheckpointError(f"model.init_from={source}: its {params:,} parameters need at least "
                          f"{_gib(params * per_param)} {what}, and this machine has {_gib(have)} available "
                          f"(MemAvailable in /proc/meminfo)")


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB" if size >= 2**30 else f"{size / 2**20:,.1f} MiB"


def check_import(model: ModelConfig, training_on_cpu: bool) -> None:
    """Before ``dipaco pretrain`` builds the path model: the checkpoint's weights fetched (a hub model's), their
    shapes checked against its config.json and their count against the available memory."""
    assert model.init_from is not None
    params = check_weight_shapes(source_dir(model.init_from, WEIGHT_FILES), model)
    check_memory(params, training_on_cpu, model.init_from)


def special_token_ids(source: str) -> dict[str, Any] | None:
    """The special-token ids (:data:`SPECIAL_IDS`) that ``source``'s config.json sets, read where it already is
    (its local directory, or the hub cache: nothing is downloaded); None when it is in neither."""
    local = Path(source).expanduser()
    path: Any = local / "config.json"
    if not local.is_dir():
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(source, "config.json") if _HUB_NAME.match(source) else None
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8")) if isinstance(path, (str, Path)) else None
    except (OSError, ValueError):
        return None
    return {key: raw[key] for key in SPECIAL_IDS if key in raw} if isinstance(raw, dict) else None


def _skipped(name: str, tied: bool) -> bool:
    """Tensors a checkpoint may hold that are not parameters of the path: old RoPE buffers, and a tied head
    (the embedding matrix, saved a second time by some exporters)."""
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


@torch.no_grad()
def import_weights(model: PreTrainedModel, source: str) -> None:
    """Copies the checkpoint ``source``'s weights into ``model`` (built from the resolved ``model`` section), in
    place, one tensor at a time; every parameter must be in the checkpoint with its shape."""
    directory = source_dir(source, WEIGHT_FILES)
    params = dict(model.named_parameters())
    tied = bool(model.config.tie_word_embeddings)
    seen: set[str] = set()
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if _skipped(name, tied):
                    continue
                if name not in params:
                    raise CheckpointError(f"{file}: {name} is not a parameter of the Llama path model")
                value = tensors.get_tensor(name)
                if value.shape != params[name].shape:
                    raise CheckpointError(f"{file}: {name} has shape {tuple(value.shape)}, the path model's is "
                                          f"{tuple(params[name].shape)}")
                params[name].copy_(value)
                _check_finite(params[name], file, name)
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"{directory}: the checkpoint lacks {len(missing)} parameters of the model, e.g. {missing[:3]}")


def _check_finite(param: torch.Tensor, file: Path, name: str) -> None:
    """Refuses a NaN or an infinity in an imported tensor. One sum is the screen: it is finite unless a value is
    not (or the sum overflows, which the exact count then clears)."""
    if bool(torch.isfinite(param.sum())):
        return
    bad = int((~torch.isfinite(param)).sum())
    if bad:
        raise CheckpointError(f"{file}: {name} holds {bad:,} non-finite values (NaN or inf) of {param.numel():,}; "
                              f"a damaged checkpoint trains a NaN model")
