"""Export the example model repository behind `make models`.

The server and its tests need real Paddle inference models without downloading anything, so this
builds real architectures with seeded random weights, saves them with `paddle.jit.save` and writes
a Triton-style `config.pbtxt` beside each. Every model is exported into a temp dir and renamed into
place, so a half-written model never appears in the repository. Models are readable by everyone
(directories 0755, files 0644): a container runs the server as another user (the image's uid
10001) over a read-only mount of the repository.

`--legacy` writes legacy programs (`inference.pdmodel`), the only format the GPU build on PyPI
(paddlepaddle-gpu 2.6) reads, for the models whose layers export that way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("GLOG_v", "0")
# Paddle reads FLAGS_enable_pir_api once, when it is imported: --legacy must set it first.
if "--legacy" in sys.argv[1:]:
    os.environ["FLAGS_enable_pir_api"] = "0"  # noqa: SIM112 (Paddle's spelling)
warnings.filterwarnings("ignore", message="No ccache found")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from paddle import nn  # noqa: E402

DType = Literal["float32", "int64", "int32"]
TRITON_TYPES: dict[DType, str] = {
    "float32": "TYPE_FP32",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
}
PROGRAM_FILES = ("inference.json", "inference.pdmodel")  # Paddle 3 / legacy
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Python models and ensembles: their files are copied from examples/ as they are. The
# sentiment ensemble runs tokenizer -> text_classifier -> label_postprocess; mlp_router calls
# mlp (BLS) for the rows that need it.
PIPELINES = {
    "tokenizer": "sentiment/tokenizer",
    "label_postprocess": "sentiment/label_postprocess",
    "sentiment": "sentiment/sentiment",
    "mlp_router": "bls/mlp_router",
}
# A decoupled Python model with its decoder LM exported into its version directory (the
# Python sandbox lets model.py read its own model directory only).
GENERATE = "generate"
GENERATE_SOURCE = "generate/generate"
LM_PROGRAMS = ("prefill", "decode")
# Bumped when the programs' inputs or outputs change, so an export made by an older version of
# this script is redone even though the example's files are the same.
LM_FORMAT = "2"  # 2: decode takes each layer's cache as keys_L / values_L


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: DType
    shape: tuple[int, ...]  # full shape, batch dim first; -1 = variable


@dataclass(frozen=True)
class ModelSpec:
    name: str
    factory: Callable[[], nn.Layer]
    inputs: tuple[TensorSpec, ...]
    # The names callers see, in the program's output order: Paddle names the outputs
    # fetch_name_0, fetch_name_1, ... and config.pbtxt maps these names onto them in order.
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    default: bool = True
    legacy: bool = True  # exports as a legacy program (--legacy)
    # The last `hidden` inputs and outputs are the sequence batcher's (control and state
    # tensors): in the program, not in config.pbtxt's input/output.
    hidden: tuple[int, int] = (0, 0)
    scheduling: str = "dynamic_batching { }\n"
    # config.pbtxt as written, instead of one made from the tensors (a stand-in for one of
    # Triton's models keeps Triton's config), and text files written beside it.
    config: str | None = None
    files: tuple[tuple[str, str], ...] = ()


def mlp(*sizes: int) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them (none after the last)."""
    layers: list[nn.Layer] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


# forward() argument names must equal the InputSpec names: dy2static matches them by name.
class MLP(nn.Layer):
    def __init__(self, *sizes: int, softmax: bool = False) -> None:
        super().__init__()
        self.body = mlp(*sizes)
        self.softmax = softmax

    def forward(self, input: paddle.Tensor) -> paddle.Tensor:
        out: paddle.Tensor = self.body(input)
        return nn.functional.softmax(out, axis=-1) if self.softmax else out


class TextClassifier(nn.Layer):
    def __init__(self, vocab: int = 1000, dim: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(dim, classes)

    def forward(self, token_ids: paddle.Tensor) -> paddle.Tensor:
        hidden: paddle.Tensor = self.encoder(self.embed(token_ids))
        out: paddle.Tensor = self.head(hidden.mean(axis=1))
        return out


class TwoTower(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.user_tower = mlp(32, 64, 16)
        self.item_tower = mlp(48, 64, 16)

    def forward(
        self, user: paddle.Tensor, item: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        u: paddle.Tensor = self.user_tower(user)
        score = (u * self.item_tower(item)).sum(axis=-1, keepdim=True)
        return u, score


class KeywordSpotter(nn.Layer):
    """A streaming keyword spotter: a GRU over chunks of audio-feature frames, scoring the
    keywords after each chunk. Its recurrent state comes in and goes out as tensors, so the
    server carries it from one request of a sequence to the next (implicit state); `start`
    (the sequence batcher's START control) resets it."""

    def __init__(self, features: int = 40, hidden: int = 64, keywords: int = 12) -> None:
        super().__init__()
        # A cell stepped over the chunk's frames: nn.GRU's exported program mistypes its
        # final state under Paddle 3's PIR ("tensor<1x-1x64xf32> ... must be equal to ...").
        self.cell = nn.GRUCell(features, hidden)
        self.head = nn.Linear(hidden, keywords)

    def forward(
        self, features: paddle.Tensor, start: paddle.Tensor, state: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        hidden = state * (1.0 - start)
        for frame in range(KWS_FRAMES):
            _, hidden = self.cell(features[:, frame], hidden)
        scores = nn.functional.softmax(self.head(hidden), axis=-1)
        return scores, hidden


KWS_FRAMES, KWS_FEATURES, KWS_HIDDEN = 8, 40, 64
# Triton's sequence batcher, as the keyword spotter's config.pbtxt has it.
KWS_SEQUENCES = f"""sequence_batching {{
  max_sequence_idle_microseconds: 5000000
  control_input [
    {{ name: "start", control [ {{ kind: CONTROL_SEQUENCE_START, fp32_false_true: [ 0, 1 ] }} ] }}
  ]
  state [
    {{
      input_name: "gru_state"
      output_name: "gru_state_out"
      data_type: TYPE_FP32
      dims: [ {KWS_HIDDEN} ]
      initial_state {{
        data_type: TYPE_FP32, dims: [ {KWS_HIDDEN} ], zero_data: true, name: "zeros"
      }}
    }}
  ]
  direct {{ }}
}}
"""


class DecoderBlock(nn.Layer):
    """Pre-norm causal self-attention and MLP, in two halves around the attention (which
    prefill and decode do differently): queries, keys and values [batch, heads, time,
    head_dim] from the input; the block's output from the attended values."""

    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.qkv, self.proj = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 3 * dim),
            nn.Linear(dim, dim),
        )
        self.norm2, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def qkv_heads(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        b, t, d = x.shape[0], x.shape[1], x.shape[2]
        qkv = self.qkv(self.norm1(x)).reshape([b, t, 3, self.heads, d // self.heads])
        qkv = qkv.transpose([2, 0, 3, 1, 4])
        return qkv[0], qkv[1], qkv[2]

    def finish(self, x: paddle.Tensor, attended: paddle.Tensor) -> paddle.Tensor:
        b, t, d = x.shape[0], x.shape[1], x.shape[2]
        x = x + self.proj(attended.transpose([0, 2, 1, 3]).reshape([b, t, d]))
        out: paddle.Tensor = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return out


def attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: paddle.Tensor
) -> paddle.Tensor:
    scores = (q @ k.transpose([0, 1, 3, 2])) * (1.0 / q.shape[-1] ** 0.5) + bias
    out: paddle.Tensor = nn.functional.softmax(scores, axis=-1) @ v
    return out


class DecoderLM(nn.Layer):
    """A GPT-style decoder-only language model (learned positions, pre-norm blocks) for the
    `generate` example, exported as two programs that share its weights: `prefill` (one prompt,
    all positions at once) and `decode` (one new token per sequence against a key/value cache
    of fixed capacity `context`, so a step's shapes depend on the batch size only)."""

    def __init__(
        self,
        vocab: int,
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        ffn: int = 512,
        context: int = 256,
    ) -> None:
        super().__init__()
        self.context, self.heads, self.head_dim = context, heads, dim // heads
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.LayerList([DecoderBlock(dim, heads, ffn) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)


class Prefill(nn.Layer):
    """token_ids [1, n] -> logits of the last position [1, vocab], and the prompt's keys and
    values [1, layers, 2, heads, n, head_dim] for the cache."""

    def __init__(self, lm: DecoderLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, token_ids: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        lm, t = self.lm, token_ids.shape[1]
        x = lm.embed(token_ids) + lm.pos(paddle.arange(t, dtype="int64")).unsqueeze(0)
        bias = (paddle.tril(paddle.ones([t, t], dtype="float32")) - 1.0) * 1e9
        kv = []
        for block in lm.blocks:
            q, k, v = block.qkv_heads(x)
            kv.append(paddle.stack([k, v], axis=1))  # [1, 2, heads, t, head_dim]
            x = block.finish(x, attention(q, k, v, bias))
        logits: paddle.Tensor = lm.head(lm.norm(x[:, -1, :]))
        return logits, paddle.stack(kv, axis=1)


class Decode(nn.Layer):
    """token_ids [b, 1] at positions [b] (each sequence's length so far) with the cache of
    each layer, keys_L and values_L [b, heads, context, head_dim] (slots at and beyond a
    sequence's position are masked out) -> logits [b, vocab] and the new token's keys and
    values [b, layers, 2, heads, 1, head_dim]. The cache is only read (never concatenated or
    sliced: a copy of it would cost more than the attention); the new token attends to itself
    separately. dy2static needs the inputs as named arguments: two layers."""

    def __init__(self, lm: DecoderLM) -> None:
        super().__init__()
        if len(lm.blocks) != 2:
            raise ValueError("Decode's inputs name two layers' caches")
        self.lm = lm

    def forward(
        self,
        token_ids: paddle.Tensor,
        positions: paddle.Tensor,
        keys_0: paddle.Tensor,
        values_0: paddle.Tensor,
        keys_1: paddle.Tensor,
        values_1: paddle.Tensor,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        lm, caches = self.lm, ((keys_0, values_0), (keys_1, values_1))
        x = lm.embed(token_ids) + lm.pos(positions).unsqueeze(1)
        slots = paddle.arange(lm.context, dtype="int64").unsqueeze(0)
        valid = (slots < positions.unsqueeze(1)).astype("float32")  # [b, context]
        bias = ((valid - 1.0) * 1e9).unsqueeze(1).unsqueeze(1)  # [b, 1, 1, context]
        scale = 1.0 / lm.head_dim**0.5
        kv = []
        for index, block in enumerate(lm.blocks):  # dy2static's zip takes no strict=
            keys, values = caches[index]
            q, k, v = block.qkv_heads(x)  # [b, heads, 1, head_dim]
            kv.append(paddle.stack([k, v], axis=1))
            cached = q.matmul(keys, transpose_y=True) * scale + bias
            own = (q * k).sum(axis=-1, keepdim=True) * scale
            weights = nn.functional.softmax(paddle.concat([cached, own], axis=-1), axis=-1)
            attended = weights[:, :, :, : lm.context] @ values + weights[:, :, :, lm.context :] * v
            x = block.finish(x, attended)
        logits: paddle.Tensor = lm.head(lm.norm(x[:, -1, :]))
        return logits, paddle.stack(kv, axis=1)


class ImageClassifier(nn.Layer):
    """A classifier over one NCHW image, answering its logits as [1, classes, 1, 1] (an ONNX
    convolutional head's shape): the interface of Triton's `densenet_onnx` example model."""

    def __init__(self, net: nn.Layer, classes: int = 1000) -> None:
        super().__init__()
        self.net, self.classes = net, classes

    def forward(self, data_0: paddle.Tensor) -> paddle.Tensor:
        out: paddle.Tensor = self.net(data_0).reshape([-1, self.classes, 1, 1])
        return out


# Triton's densenet_onnx config (docs/examples/model_repository of triton-inference-server/
# server), Paddle's platform in place of ONNX Runtime's: clients send and receive `dims`, the
# program sees `reshape.shape`; its labels are ours (one made-up name per class).
DENSENET_LABELS = "densenet_labels.txt"
DENSENET_CONFIG = f"""name: "densenet_onnx"
platform: "paddle_inference"
max_batch_size: 0
input [
  {{
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape {{ shape: [ 1, 3, 224, 224 ] }}
  }}
]
output [
  {{
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape {{ shape: [ 1, 1000, 1, 1 ] }}
    label_filename: "{DENSENET_LABELS}"
  }}
]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""


def densenet_labels() -> str:
    return "".join(f"class_{i:03d}\n" for i in range(1000))


def f32(name: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, "float32", shape)


MODELS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "mlp",
        lambda: MLP(256, 128, 10, softmax=True),
        (f32("input", -1, 256),),
        (f32("probabilities", -1, 10),),
        64,
    ),
    ModelSpec(
        "resnet18",
        lambda: paddle.vision.models.resnet18(pretrained=False),
        (f32("image", -1, 3, 224, 224),),
        (f32("logits", -1, 1000),),
        16,
    ),
    ModelSpec(
        "text_classifier",
        TextClassifier,
        (TensorSpec("token_ids", "int64", (-1, -1)),),
        (f32("logits", -1, 4),),
        32,
        legacy=False,  # the Transformer encoder's attention does not translate to legacy ops
    ),
    ModelSpec(
        "two_tower",
        TwoTower,
        (f32("user", -1, 32), f32("item", -1, 48)),
        (f32("user_embedding", -1, 16), f32("score", -1, 1)),
        64,
        legacy=False,  # Tensor.sum has no legacy translation
    ),
    # A sequence model: the server keeps each sequence's GRU state between its requests.
    ModelSpec(
        "kws",
        KeywordSpotter,
        (
            f32("features", -1, KWS_FRAMES, KWS_FEATURES),
            f32("start", -1, 1),
            f32("gru_state", -1, KWS_HIDDEN),
        ),
        (f32("scores", -1, 12), f32("gru_state_out", -1, KWS_HIDDEN)),
        64,
        hidden=(2, 1),
        scheduling=KWS_SEQUENCES,
    ),
    # Stands in for Triton's densenet_onnx, for its image clients (image_client.py,
    # grpc_image_client.py): DenseNet-121, 32 MB, exported on demand (`--only densenet_onnx`):
    # in the default repository every server started on it would pay its load and warm-up.
    ModelSpec(
        "densenet_onnx",
        lambda: ImageClassifier(paddle.vision.models.densenet121(pretrained=False)),
        (f32("data_0", 1, 3, 224, 224),),
        (f32("fc6_1", 1, 1000, 1, 1),),
        0,
        default=False,
        config=DENSENET_CONFIG,
        files=((DENSENET_LABELS, densenet_labels()),),
    ),
    # One call is dominated by its ~100 MB of weights: used by the batching benchmark.
    ModelSpec(
        "mlp_wide",
        lambda: MLP(2048, 4096, 4096, 10),
        (f32("input", -1, 2048),),
        (f32("logits", -1, 10),),
        128,
        default=False,
    ),
)


def config_pbtxt(spec: ModelSpec) -> str:
    if spec.config is not None:
        return spec.config

    def block(tensors: Sequence[TensorSpec]) -> str:
        lines = []
        for t in tensors:
            dims = t.shape[1:] if spec.max_batch_size > 0 else t.shape
            dtype, dims_text = TRITON_TYPES[t.dtype], ", ".join(str(d) for d in dims)
            lines.append(f'  {{ name: "{t.name}", data_type: {dtype}, dims: [ {dims_text} ] }}')
        return ",\n".join(lines)

    inputs = spec.inputs[: len(spec.inputs) - spec.hidden[0]]
    outputs = spec.outputs[: len(spec.outputs) - spec.hidden[1]]
    return (
        f'name: "{spec.name}"\n'
        'platform: "paddle_inference"\n'
        f"max_batch_size: {spec.max_batch_size}\n"
        f"input [\n{block(inputs)}\n]\n"
        f"output [\n{block(outputs)}\n]\n"
        "instance_group [ { kind: KIND_CPU, count: 1 } ]\n"
        f"{spec.scheduling}"
    )


def is_exported(model_dir: Path, legacy: bool) -> bool:
    """Exported already, in the program format asked for."""
    version = model_dir / "1"
    program = PROGRAM_FILES[1] if legacy else PROGRAM_FILES[0]
    return (model_dir / "config.pbtxt").is_file() and all(
        (version / f).is_file() for f in (program, "inference.pdiparams")
    )


def export(spec: ModelSpec, out: Path, version: int = 1) -> int:
    """Export one model into out/NAME atomically; returns its size in bytes. A version other
    than 1 (other weights, same architecture) is added as out/NAME/VERSION, also atomically."""
    # Stable per model and version, independent of export order.
    seed = zlib.crc32(spec.name.encode()) + version - 1
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=out))
    try:
        paddle.seed(seed)
        np.random.seed(seed)
        # Fresh parameter names per model, so names don't depend on what was built before.
        with paddle.utils.unique_name.guard():
            layer = spec.factory()
        input_spec = [paddle.static.InputSpec(list(t.shape), t.dtype, t.name) for t in spec.inputs]
        paddle.jit.save(layer.eval(), str(tmp / str(version) / "inference"), input_spec=input_spec)
        if version != 1:
            make_readable(tmp / str(version))
            os.replace(tmp / str(version), out / spec.name / str(version))
            return sum(p.stat().st_size for p in (out / spec.name / str(version)).rglob("*"))
        (tmp / "config.pbtxt").write_text(config_pbtxt(spec))
        for name, text in spec.files:
            (tmp / name).write_text(text)
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        _install(tmp, out / spec.name)
        return size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_readable(root: Path) -> None:
    """Directories 0755, files 0644, whatever the umask and mkdtemp's 0700 made them."""
    for path in (root, *root.rglob("*")):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def _install(tmp: Path, target: Path) -> None:
    """Move a finished model directory into place in one step."""
    make_readable(tmp)
    if target.exists():  # os.replace cannot replace a non-empty directory: move it aside
        old = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
        os.replace(target, old / target.name)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)


def _holds_files_of(target: Path, source: Path) -> bool:
    """Whether every file under `source` is in `target` too, with the same bytes (extra
    files in `target`, such as an exported program, do not count)."""
    files = (p.relative_to(source) for p in source.rglob("*") if p.is_file())
    return all(
        (target / f).is_file() and (target / f).read_bytes() == (source / f).read_bytes()
        for f in files
    )


def copy_example(name: str, out: Path) -> bool:
    """Copy a Python model or ensemble from examples/ into out/NAME atomically, unless it is
    there already with the same files; whether it copied."""
    source, target = EXAMPLES / PIPELINES[name], out / name
    if target.is_dir() and _holds_files_of(target, source):
        return False
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=out))
    try:
        shutil.copytree(source, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
        _install(tmp / name, target)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_generate(out: Path, force: bool) -> bool:
    """Copy the `generate` example and export its decoder LM into 1/lm/{prefill,decode},
    atomically, unless it is there already with the same example files; whether it did."""
    source, target = EXAMPLES / GENERATE_SOURCE, out / GENERATE
    programs = [target / "1" / "lm" / name / PROGRAM_FILES[0] for name in LM_PROGRAMS]
    stamp = target / "1" / "lm" / "FORMAT"
    if (
        not force
        and all(p.is_file() for p in programs)
        and stamp.is_file()
        and stamp.read_text().strip() == LM_FORMAT
        and _holds_files_of(target, source)
    ):
        return False
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{GENERATE}-", dir=out))
    try:
        shutil.copytree(source, tmp / GENERATE, ignore=shutil.ignore_patterns("__pycache__"))
        vocab = len(json.loads((source / "1" / "vocab.json").read_text()))
        seed = zlib.crc32(GENERATE.encode())
        paddle.seed(seed)
        np.random.seed(seed)
        with paddle.utils.unique_name.guard():
            lm = DecoderLM(vocab).eval()
        heads, head_dim, layers = lm.heads, lm.head_dim, len(lm.blocks)
        specs = {
            "prefill": [paddle.static.InputSpec([1, None], "int64", "token_ids")],
            "decode": [
                paddle.static.InputSpec([None, 1], "int64", "token_ids"),
                paddle.static.InputSpec([None], "int64", "positions"),
                *(
                    paddle.static.InputSpec(
                        [None, heads, lm.context, head_dim], "float32", f"{kind}_{layer}"
                    )
                    for layer in range(layers)
                    for kind in ("keys", "values")
                ),
            ],
        }
        for name, layer in (("prefill", Prefill(lm)), ("decode", Decode(lm))):
            path = tmp / GENERATE / "1" / "lm" / name / "inference"
            paddle.jit.save(layer.eval(), str(path), input_spec=specs[name])
        (tmp / GENERATE / "1" / "lm" / "FORMAT").write_text(LM_FORMAT + "\n")
        _install(tmp / GENERATE, target)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    names = [m.name for m in MODELS] + list(PIPELINES) + [GENERATE]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="model repository directory")
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=", ".join(names))
    parser.add_argument("--all", action="store_true", help="also export non-default models")
    parser.add_argument("--force", action="store_true", help="re-export models already present")
    parser.add_argument(
        "--legacy",
        action="store_true",
        help="legacy programs (inference.pdmodel) for paddlepaddle-gpu 2.6; models whose "
        "layers cannot export that way are skipped",
    )
    parser.add_argument(
        "--add-version",
        type=int,
        metavar="N",
        help="add version N (other random weights) to models already exported",
    )
    args = parser.parse_args(argv)

    if args.only:
        selected = [m for m in MODELS if m.name in args.only]
    else:
        selected = [m for m in MODELS if m.default or args.all]
    if args.legacy != (os.environ.get("FLAGS_enable_pir_api") == "0"):  # noqa: SIM112
        raise SystemExit(
            "--legacy and FLAGS_enable_pir_api=0 go together; pass --legacy on the command "
            "line (Paddle reads the flag when it is imported)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    paddle.device.set_device("cpu")
    for spec in selected:
        if args.legacy and not spec.legacy:
            print(f"exporting {spec.name} ... skipped (no legacy export)", flush=True)
            continue
        if args.add_version:
            if not is_exported(args.out / spec.name, args.legacy):
                raise SystemExit(f"{spec.name} is not exported in {args.out}; export it first")
            size = export(spec, args.out, args.add_version)
            print(f"added {spec.name} version {args.add_version}, {size / 1e6:.1f} MB", flush=True)
            continue
        if not args.force and is_exported(args.out / spec.name, args.legacy):
            make_readable(args.out / spec.name)  # exported before models were made readable
            model_dir = args.out / spec.name
            texts = {"config.pbtxt": config_pbtxt(spec), **dict(spec.files)}
            stale = [
                name
                for name, text in texts.items()
                if not (model_dir / name).is_file() or (model_dir / name).read_text() != text
            ]
            for name in stale:
                (model_dir / name).write_text(texts[name])
                (model_dir / name).chmod(0o644)
            if stale:
                updated = ", ".join(stale)
                print(f"exporting {spec.name} ... weights kept, {updated} updated", flush=True)
            else:
                print(f"exporting {spec.name} ... skipped (already exported)", flush=True)
            continue
        print(f"exporting {spec.name} ... ", end="", flush=True)
        start = time.perf_counter()
        size = export(spec, args.out)
        print(f"done in {time.perf_counter() - start:.1f} s, {size / 1e6:.1f} MB", flush=True)
    if args.add_version:
        return 0
    for name in PIPELINES:
        if args.only and name not in args.only:
            continue
        copied = copy_example(name, args.out)
        print(f"copying {name} ... {'done' if copied else 'skipped (up to date)'}", flush=True)
    if args.only and GENERATE not in args.only:
        return 0
    if args.legacy:  # paddle.tril (the causal mask) has no legacy translation
        print(f"exporting {GENERATE} ... skipped (no legacy export)", flush=True)
        return 0
    print(f"exporting {GENERATE} ... ", end="", flush=True)
    done = export_generate(args.out, args.force)
    print("done" if done else "skipped (up to date)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
