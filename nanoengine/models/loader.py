"""Load Hugging Face safetensors into our (fused) parameters, with a clear report of what did not fit.
Chapter 02.

Checkpoint names map onto ours: `model.layers.0.self_attn.q_proj.weight` -> the "q" rows of
`layers.0.self_attn.qkv_proj.weight`; the `model.` prefix is dropped; a tied `lm_head.weight` is optional.
A model may map names itself (`checkpoint_name(name) -> (param, shard) | None`): a mixture of experts'
per-expert tensors go into their expert's slice of a stacked weight (layers/moe.py).
Each parameter's `weight_loader` gets a lazy safetensors slice and reads only what it holds, so under tensor
parallelism (chapter 07) every rank reads its own shard of the same files and nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from nanoengine.errors import CheckpointError
from nanoengine.layers.linear import default_weight_loader


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}; "
                              "nanoengine loads Hugging Face safetensors folders")
    return files


def load_model(model: nn.Module, path: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    rename = getattr(model, "checkpoint_name", None)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in checkpoint_files(path):
        try:
            load_file(model, file, params, packed, loaded, unexpected, rename)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' own errors: a corrupt header, a truncated file
            raise CheckpointError(f"checkpoint file {file} could not be read ({type(e).__name__}: {e}); it "
                                  "may be corrupt or truncated: download or convert it again") from e
    report_mismatch(model, path, loaded, unexpected)


def load_file(model: nn.Module, file: Path, params: dict, packed: dict, loaded: set[str],
              unexpected: list[str], rename: Callable[[str], tuple[str, Any] | None] | None = None) -> None:
    """Load every tensor of one safetensors file into its parameter (or note it as unexpected)."""
    with safe_open(str(file), "pt") as f:
        for ckpt_name in f.keys():
            name = ckpt_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            shard = None
            target = rename(name) if rename is not None else None
            if target is not None:
                name, shard = target
            else:
                for frag, (ours, part) in packed.items():
                    if f".{frag}." in name:
                        name, shard = name.replace(f".{frag}.", f".{ours}."), part
                        break
            param = params.get(name)
            if param is None:
                unexpected.append(ckpt_name)
                continue
            tensor = f.get_slice(ckpt_name)  # lazy: the loader reads its rows or columns only
            stored = tensor.get_dtype()  # safetensors' name: "BF16", "F32", "I64", ...
            if param.dtype.is_floating_point and not stored.startswith(("F", "BF")):
                raise CheckpointError(f"checkpoint {file}: tensor {ckpt_name!r} is stored as {stored}, but "
                                      f"the model's {name!r} holds floating-point weights; the file was "
                                      "written wrongly (a quantized or corrupted export?): convert the "
                                      "checkpoint again")
            try:
                with torch.no_grad():
                    if shard is None:
                        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    else:
                        param.weight_loader(param, tensor, shard)
            except ValueError as e:
                raise CheckpointError(f"checkpoint {file}: tensor {ckpt_name!r} does not fit the model's "
                                      f"{name!r}: {e}") from None
            loaded.add(name if shard is None else f"{name}:{_shard_id(shard)}")


def _shard_id(shard: Any) -> str:
    """A shard's id in the loaded set: "q", or "3:gate" for expert 3's gate rows."""
    return ":".join(map(str, shard)) if isinstance(shard, tuple) else str(shard)


def report_mismatch(model: nn.Module, path: Path, loaded: set[str], unexpected: list[str]) -> None:
    """A CheckpointError listing the parameters no tensor filled and the tensors no parameter took."""
    missing = []
    for name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            parts = getattr(module, "part_offsets", None)
            expected = getattr(module, "expected_parts", {}).get(pname)  # a stack of experts' slices
            if expected is not None:
                need = [f"{full}:{p}" for p in expected]
            elif parts and pname in ("weight", "bias"):
                need = [f"{full}:{p}" for p in parts]
            else:
                need = [full]
            missing += [n for n in need if n not in loaded]
    if getattr(model, "tie_word_embeddings", False):
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''} ({len(missing)} in all); unexpected "
                              f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} "
                              f"({len(unexpected)} in all)")
