"""A draft that ships without token embeddings and takes its target's at load time.

A draft made from its target's bottom layers (a layer-dropped draft) shares the target's width, so it can share
its token embeddings, and with them the tied output head, exactly. At 49,152 ids × 576 those are 57 MB in float16,
more than the rest of a two-layer draft several times over, and the target already holds them. Such a draft's
directory holds `embeddings_from.json` naming the source (a pinned wheel's GGUF file, found in the model cache and
dequantized like any GGUF model, or a model directory) and the tensor's SHA-256; its weight file lacks the
embedding, which is read from the source's safetensors and checked before it is put in place
(docs/architecture.md, "A draft's head over part of the vocabulary").
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import torch
from safetensors import safe_open
from torch import nn

from specdec.engine.gguf_checkpoint import resolve_model
from specdec.engine.pinned_wheel import WheelFile

EMBEDDINGS_FILE = "embeddings_from.json"
EMBEDDING_TENSOR = "model.embed_tokens.weight"


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's float32 bytes."""
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()


def write_embeddings_source(model_dir: pathlib.Path, wheel_file: WheelFile, embedding: torch.Tensor) -> None:
    """Records in model_dir that its embedding is the pinned wheel's GGUF model's, with the tensor's SHA-256."""
    source = {"package": wheel_file.package, "version": wheel_file.version, "member": wheel_file.member}
    source["sha256"] = wheel_file.sha256
    record = {"wheel_gguf": source, "tensor": EMBEDDING_TENSOR, "tensor_sha256": tensor_sha256(embedding)}
    (model_dir / EMBEDDINGS_FILE).write_text(json.dumps(record, indent=1) + "\n")


def embeddings_source(model_dir: str) -> dict | None:
    """What a model directory's `embeddings_from.json` says, or None when it has its own embeddings."""
    path = pathlib.Path(model_dir) / EMBEDDINGS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def borrowed_embedding(record: dict) -> torch.Tensor:
    """The embedding tensor a record names, float32, checked against its SHA-256. Raises FileNotFoundError when the
    source is not in the model cache (`python -m specdec fetch`), ValueError when the tensor differs."""
    source = WheelFile(**record["wheel_gguf"]).path()
    if not source.is_file():
        raise FileNotFoundError(
            f"the draft's embeddings come from {source}, which is not fetched (python -m specdec fetch)"
        )
    directory = pathlib.Path(resolve_model(str(source)))
    with safe_open(str(directory / "model.safetensors"), framework="pt") as weights:
        tensor = weights.get_tensor(record["tensor"]).float()
    if tensor_sha256(tensor) != record["tensor_sha256"]:
        raise ValueError(f"{record['tensor']} of {source} is not the tensor the draft was made with")
    return tensor


@torch.no_grad()
def use_borrowed_embeddings(model: nn.Module, record: dict) -> None:
    """Puts the named embedding into `model` (and so into its tied head)."""
    tensor = borrowed_embedding(record)
    embedding = model.get_input_embeddings()
    if tuple(embedding.weight.shape) != tuple(tensor.shape):
        raise ValueError(f"borrowed embedding {tuple(tensor.shape)} does not fit {tuple(embedding.weight.shape)}")
    embedding.weight.copy_(tensor.to(embedding.weight.dtype))
