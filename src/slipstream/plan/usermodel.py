"""The user's own model for ``slipstream plan --model``: measured from the model, on the meta device.

Two forms:

* ``PATH.py:FUNCTION`` -- a function (or class) in a Python file that builds the ``nn.Module``
  with no arguments. One sample's input (batch of 1) comes, in this order, from a function
  ``sample_input(model)`` in the same file, from ``--input-shape`` (e.g. ``3,32,32``), or is
  inferred from the first layer: an ``nn.Embedding`` takes token ids of the model's context
  (an attribute ``context``, ``block_size``, ``max_seq_len``, ``seq_len`` or ``n_positions``,
  else the size of a positional embedding, else 128); an ``nn.Conv2d`` a 224 x 224 image with
  its input channels; an ``nn.Linear`` a vector of its input features.
* ``config.json`` -- a Hugging Face model config (needs the optional ``transformers``),
  built with ``AutoModelForCausalLM.from_config``; one sample is a sequence of the config's
  context length (``n_positions`` / ``max_position_embeddings``).

The model is built under ``torch.device("meta")``, so nothing is allocated. From it, measured:

* parameters: ``sum(p.numel())`` over unique parameters (tied weights once);
* forward FLOPs per sample: ``torch.utils.flop_counter.FlopCounterMode`` over one forward pass
  at batch 1 (it counts matmuls, convolutions and attention from shapes alone, so meta tensors
  suffice); training = 3 x forward (the cost model's rule);
* activation memory per sample: the bytes of every tensor autograd saves for backward in that
  forward pass (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded, each saved
  tensor counted once. An estimate: a view saved beside its base counts twice, and buffers
  freed early by the allocator are still counted.

Example::

    spec = load_user_model("examples/train_resnet.py:ResNet18", input_shape=(3, 32, 32))
    spec.params, spec.fwd_flops_per_sample, spec.act_bytes_per_sample("fp32")
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..extras import pip_install_hint
from .specs import ModelSpec

_CONTEXT_ATTRS = ("context", "block_size", "max_seq_len", "seq_len", "n_positions", "max_position_embeddings")


def is_user_model(spec: str) -> bool:
    """True for ``PATH.py:FUNCTION`` and ``*.json`` (a built-in name has neither)."""
    s = str(spec)
    return s.endswith(".json") or ".py:" in s or s.endswith(".py")


def load_user_model(spec: str, input_shape: tuple[int, ...] | None = None) -> ModelSpec:
    """A :class:`ModelSpec` measured from the user's model (module docstring); ConfigError on bad input."""
    s = str(spec)
    if s.endswith(".json"):
        return _from_hf_config(s)
    path, _, func = s.rpartition(":")
    if not path.endswith(".py") or not func:
        raise ConfigError(f"--model: expected a built-in name, PATH.py:FUNCTION or a config.json, got {spec!r}")
    return _from_python(path, func, input_shape)


def _import_file(path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"--model: no such file: {path}")
    name = "slipstream_user_model_" + Path(path).stem.replace("-", "_")
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"--model: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any error is theirs, reported in one line
        raise ConfigError(f"--model: importing {path} failed: {type(exc).__name__}: {_first_line(exc)}") from None
    return module


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def _from_python(path: str, func: str, input_shape: tuple[int, ...] | None) -> ModelSpec:
    import torch
    from torch import nn

    module = _import_file(path)
    build = getattr(module, func, None)
    if build is None or not callable(build):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"--model: {path} has no function {func!r} (it defines: {', '.join(names) or 'none'})")
    try:
        with torch.device("meta"):
            model = build()
    except Exception as exc:
        raise ConfigError(f"--model: {path}:{func}() failed: {type(exc).__name__}: {_first_line(exc)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model: {path}:{func}() must return a torch.nn.Module, got {type(model).__name__}")
    sample_fn = getattr(module, "sample_input", None)
    with torch.device("meta"):
        if callable(sample_fn):
            x = sample_fn(model)
        else:
            x = _infer_input(model, input_shape, f"{path}:{func}")
    return _measure(model, x, name=f"{Path(path).name}:{func}", source=f"measured from {path}:{func} on meta")


def _infer_input(model: Any, input_shape: tuple[int, ...] | None, where: str):
    import torch
    from torch import nn

    first = next((m for m in model.modules() if isinstance(m, nn.Embedding | nn.Conv1d | nn.Conv2d | nn.Conv3d
                                                         | nn.Linear)), None)
    if isinstance(first, nn.Embedding):
        shape = input_shape or (_context(model),)
        return torch.zeros((1, *shape), dtype=torch.long)
    if input_shape:
        return torch.zeros((1, *input_shape))
    if isinstance(first, nn.Conv2d):
        return torch.zeros((1, first.in_channels, 224, 224))
    if isinstance(first, nn.Linear):
        return torch.zeros((1, first.in_features))
    raise ConfigError(f"--model: cannot infer one sample's input for {where}; pass --input-shape "
                      f"(e.g. 3,224,224) or define sample_input(model) in the file")


def _context(model: Any) -> int:
    from torch import nn

    for attr in _CONTEXT_ATTRS:
        for obj in (model, getattr(model, "config", None)):
            value = getattr(obj, attr, None) if obj is not None else None
            if isinstance(value, int) and value > 0:
                return value
    pos = [m.num_embeddings for n, m in model.named_modules() if isinstance(m, nn.Embedding) and "pos" in n]
    return min(pos) if pos else 128


def _from_hf_config(path: str) -> ModelSpec:
    if not os.path.isfile(path):
        raise ConfigError(f"--model: no such file: {path}")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model: {path} is not valid JSON: {_first_line(exc)}") from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ConfigError(f"--model: {path} is not a Hugging Face config (no \"model_type\")")
    try:
        import transformers
    except ImportError:
        raise ConfigError("--model: a config.json needs the optional dependency transformers "
                          f"({pip_install_hint('hf')})") from None
    import torch

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its config warnings are not ours to print
    try:
        config = transformers.AutoConfig.for_model(**doc)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise ConfigError(f"--model: cannot build a causal LM from {path}: {type(exc).__name__}: "
                          f"{_first_line(exc)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    seq = next((getattr(config, a) for a in ("n_positions", "max_position_embeddings", "seq_length")
                if isinstance(getattr(config, a, None), int)), 1024)
    layers = next((getattr(config, a) for a in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(getattr(config, a, None), int)), 1)
    d = next((getattr(config, a) for a in ("hidden_size", "n_embd", "d_model")
              if isinstance(getattr(config, a, None), int)), 0)
    heads = next((getattr(config, a) for a in ("num_attention_heads", "n_head")
                  if isinstance(getattr(config, a, None), int)), 0)
    with torch.device("meta"):
        x = torch.zeros((1, seq), dtype=torch.long)
    spec = _measure(model, x, name=Path(path).name, source=f"measured from {path} ({doc['model_type']}) on meta",
                    logits_of=lambda out: out.logits)
    import dataclasses

    # A transformer to the planner (tensor and pipeline parallel apply), with the measured
    # activations in place of the formula's.
    return dataclasses.replace(spec, kind="transformer", layers=layers, seq_len=seq, d_model=d, heads=heads,
                               vocab=int(getattr(config, "vocab_size", 0) or 0), mfu_fp32=0.55, mfu_16=0.45,
                               half_batch=0.25, matrix_aspect=4.0, default_batch_per_gpu=1,
                               default_global_batch=max(1, 2**19 // seq))


def _measure(model: Any, x: Any, name: str, source: str, logits_of=None) -> ModelSpec:
    """Parameters, forward FLOPs and saved activation bytes of one sample (batch 1, fp32) on meta."""
    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    params = {id(p): p for p in model.parameters()}
    n_params = sum(p.numel() for p in params.values())
    if n_params == 0:
        raise ConfigError(f"--model: {name} has no parameters")
    args = x if isinstance(x, tuple) else (x,)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params and not isinstance(t, nn.Parameter):
            saved.setdefault(id(t), t.numel() * t.element_size())
        return t

    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*args)
    except Exception as exc:
        raise ConfigError(f"--model: forward of {name} on one sample failed: {type(exc).__name__}: "
                          f"{_first_line(exc)} (give the input with --input-shape or sample_input(model))") from None
    if logits_of is not None:
        out = logits_of(out)
    flops = counter.get_total_flops()
    if flops <= 0:
        raise ConfigError(f"--model: {name}: FlopCounterMode counted no FLOPs in one forward pass")
    act_fp32 = float(sum(saved.values()))
    # the output in fp32 is held for the loss as well (a transformer's logits are added by the cost
    # model itself: ModelSpec.logits_bytes_per_sample)
    if isinstance(out, torch.Tensor) and logits_of is None:
        act_fp32 += out.numel() * 4
    # The module class repeated most often: what activation checkpointing wraps (TrainConfig takes
    # class names), and the model's "layers" (one bucket/FSDP unit each).
    counts = Counter(type(m).__name__ for m in model.modules()
                     if any(True for _ in m.children()) and m is not model
                     and type(m).__name__ not in ("Sequential", "ModuleList", "ModuleDict"))
    block, repeats = counts.most_common(1)[0] if counts else ("", 0)
    leaves = sum(1 for m in model.modules() if not any(True for _ in m.children())
                 and any(True for _ in m.parameters(recurse=False)))
    layers = max(1, repeats if repeats >= 2 else leaves)
    kind = "cnn" if any(isinstance(m, nn.Conv2d) for m in model.modules()) else "mlp"
    return ModelSpec(
        name=name, kind=kind, params=float(n_params), fwd_flops_per_sample=float(flops), layers=layers,
        act_bytes_per_sample_16=act_fp32 / 2, ckpt_bytes_per_sample_16=act_fp32 / 2 / layers,
        optimizer="adam", mfu_fp32=0.5, mfu_16=0.35, half_batch=4.0, matrix_aspect=4.0,
        default_batch_per_gpu=64 if kind == "cnn" else 32, source=source, block_class=block,
        measured=True,
    )


__all__ = ["is_user_model", "load_user_model"]
