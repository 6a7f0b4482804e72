"""The paper's networks and small baselines, by name.

``build_model(name, input_shape, n_classes, **options)`` returns an
``nn.Module`` mapping a batch of shape (B, *input_shape) to (B, n_classes)
logits ((B, T, n_classes) for ``gpt``). Input shape and class count come from
the data set, so every image model runs on every image data set (8×8 digits,
28×28 MNIST, 32×32 CIFAR): convolutions are 3×3 (5×5 for LeNet) with "same"
padding and the width of the first dense layer is found by a dry run.

=============  =============================================================
``logreg``     multinomial logistic regression (one dense layer)
``mlp``        dense ReLU layers ``hidden`` (default [256, 128]; one integer
               means one hidden layer, [] none)
``fcn``        the paper's FCN: ``depth`` 20 dense ReLU layers of ``width`` 50
``lenet``      conv6(5×5)-pool-conv16(5×5)-pool-fc120-fc84
``cnn``        the paper's CNN: conv32-conv32-pool-dropout0.25-conv64-conv64-
               pool-dropout0.25-fc512 (3×3 ReLU convolutions)
``big_cnn``    the paper's Big_CNN: VGG-like blocks 3×conv64, 3×conv128,
               3×conv256, each followed by max-pooling and dropout 0.5, then
               two fc512
``lstm``       sequences (T, 1 + C): an LSTM (``hidden`` 64, ``layers`` 1),
               the state after each sequence's last step, a linear layer;
               ``packed`` (default false) skips padded steps
``gru``        the same with a GRU
``pgru``       the same with the implicit GRU of Moon & Cyr, its recurrence
               serial or solved by MGRIT over time (``mode``, ``cf`` 8,
               ``levels``, ``iters`` 4 at most, ``rtol`` 1e-3,
               ``fallback``, ``coarse``; :mod:`cdsgd.mgrit`)
``gpt``        token windows (T,) → next-token logits (B, T, V): a decoder-only transformer (:mod:`cdsgd.transformer`)
=============  =============================================================

Options (``model_params``) are checked by name against the factory's
signature and, for the built-in models, by the type of each default; errors
name the model, the option, the allowed options with defaults, the closest
name. **Your own model** ``"package.module:factory"`` is imported, not looked
up: ``factory(input_shape, n_classes, **model_params)`` returns an
``nn.Module`` mapping (B, *input_shape) to (B, n_classes) logits.

>>> m = build_model("cnn", (1, 28, 28), 10)
>>> m(torch.zeros(2, 1, 28, 28)).shape
torch.Size([2, 10])
>>> build_model("cdsgd.models:logreg", (1, 8, 8), 3)[-1]
Linear(in_features=64, out_features=3, bias=True)
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Callable, Sequence

import torch
from torch import nn

from topologies import Registry, unknown_name_error

from .base.checks import check_int
from .config import toml_value
from .data.sequences import sequence_lengths
from .mgrit import ParallelGRU
from .transformer import gpt

__all__ = ["MODELS", "STAT_PROVIDERS", "SequenceClassifier", "build_model", "check_model_options", "has_convolutions",
           "import_callable", "is_import_path", "model_options", "n_parameters", "vmap_blockers"]

MODELS: Registry[Callable[..., nn.Module]] = Registry("model")

#: module classes whose statistics reach metrics.csv (the hook :class:`cdsgd.executor.meters.ModelStats` reads)
STAT_PROVIDERS: tuple[type, ...] = (ParallelGRU,)


def _dense_head(features: nn.Module, input_shape, widths: Sequence[int], n_classes: int,
                dropout: float = 0.0) -> nn.Sequential:
    with torch.no_grad():
        flat = features(torch.zeros(1, *input_shape)).numel()
    layers: list[nn.Module] = [features, nn.Flatten()]
    for w in widths:
        layers += [nn.Linear(flat, w), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        flat = w
    layers.append(nn.Linear(flat, n_classes))
    return nn.Sequential(*layers)


def _conv_block(c_in: int, c_out: int, n: int, kernel: int = 3) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for i in range(n):
        layers += [nn.Conv2d(c_in if i == 0 else c_out, c_out, kernel, padding=kernel // 2), nn.ReLU()]
    return layers


def _channels(input_shape) -> int:
    if len(input_shape) != 3:
        raise ValueError(f"convolutional models need images of shape (C, H, W), got input_shape {tuple(input_shape)}")
    return input_shape[0]


@MODELS.register("logreg")
def logreg(input_shape, n_classes):
    return _dense_head(nn.Identity(), input_shape, [], n_classes)


@MODELS.register("mlp")
def mlp(input_shape, n_classes, hidden: Sequence[int] | int = (256, 128)):
    """Dense ReLU layers of the widths ``hidden``; one integer is one hidden layer (``64`` ≡ ``[64]``)."""
    widths = [hidden] if isinstance(hidden, int) and not isinstance(hidden, bool) else hidden
    if (not isinstance(widths, (list, tuple))
            or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths)):
        raise ValueError(f"model option hidden must be a list of layer widths (integers >= 1) or one integer "
                         f"for model 'mlp' (default [256, 128]), got {hidden!r} ({type(hidden).__name__})")
    return _dense_head(nn.Identity(), input_shape, list(widths), n_classes)


@MODELS.register("fcn")
def fcn(input_shape, n_classes, depth: int = 20, width: int = 50):
    check_int("depth", depth, 1, what="model option ")
    check_int("width", width, 1, what="model option ")
    return _dense_head(nn.Identity(), input_shape, [width] * depth, n_classes)


@MODELS.register("lenet")
def lenet(input_shape, n_classes):
    c = _channels(input_shape)
    features = nn.Sequential(*_conv_block(c, 6, 1, 5), nn.MaxPool2d(2), *_conv_block(6, 16, 1, 5), nn.MaxPool2d(2))
    return _dense_head(features, input_shape, [120, 84], n_classes)


@MODELS.register("cnn")
def cnn(input_shape, n_classes):
    c = _channels(input_shape)
    features = nn.Sequential(
        *_conv_block(c, 32, 2), nn.MaxPool2d(2), nn.Dropout(0.25),
        *_conv_block(32, 64, 2), nn.MaxPool2d(2), nn.Dropout(0.25),
    )
    return _dense_head(features, input_shape, [512], n_classes)


@MODELS.register("big_cnn")
def big_cnn(input_shape, n_classes):
    c = _channels(input_shape)
    blocks: list[nn.Module] = []
    for c_in, c_out in ((c, 64), (64, 128), (128, 256)):
        blocks += [*_conv_block(c_in, c_out, 3), nn.MaxPool2d(2), nn.Dropout(0.5)]
    return _dense_head(nn.Sequential(*blocks), input_shape, [512, 512], n_classes)


def is_import_path(name) -> bool:
    """Whether a model or data set name is ``"package.module:attribute"`` (imported, not looked up)."""
    return isinstance(name, str) and ":" in name


def import_callable(spec: str, kind: str) -> Callable:
    """The callable ``attribute`` of ``package.module`` named by ``spec = "package.module:attribute"``.

    ``kind`` ("model", "data set") starts every message. Each failure is a
    ValueError naming ``spec`` and what is expected: a malformed name, a
    module that cannot be imported (with the import's own error), a missing
    attribute (with the closest public name of the module), a value that is
    not callable.

    >>> import_callable("cdsgd.models:mlp", "model").__name__
    'mlp'
    >>> import_callable("cdsgd.models:mpl", "model")
    Traceback (most recent call last):
    ...
    ValueError: model 'cdsgd.models:mpl': module 'cdsgd.models' has no attribute 'mpl'; did you mean 'mlp'? ...
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"{kind} {spec!r}: expected a registered name or 'package.module:callable' "
                         "(one colon, a module path before it and a name after it)")
    try:
        module = _import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raised while it ran
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} cannot be imported "
                         f"({type(e).__name__}: {e}); it must be importable from the working directory, "
                         "an installed package or PYTHONPATH") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n))]
            hint = str(unknown_name_error("attribute", part, public)).partition(" is unknown")[2]
            raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{kind} {spec!r}: {attr} is of type {type(obj).__name__}, not callable; expected a function "
                         + ("factory(input_shape, n_classes, **model_params) -> torch.nn.Module" if kind == "model"
                            else "loader(data_dir) -> cdsgd.data.Dataset"))
    return obj


def _import_module(module_name: str):
    """``importlib.import_module``; the working directory is searched last (the ``cdsgd`` script omits it)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != module_name.partition(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)  # kept: the module's own imports of its neighbours must keep working
        return importlib.import_module(module_name)


def _factory(name: str) -> Callable[..., nn.Module]:
    return import_callable(name, "model") if is_import_path(name) else MODELS.get(name)


def model_options(name: str) -> dict | None:
    """The options model ``name`` takes with their defaults (``Parameter.empty``: required); None with ``**kwargs``.

    >>> model_options("fcn")
    {'depth': 20, 'width': 50}
    """
    fn = _factory(name)
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):  # a callable without a signature (a C function): names cannot be checked
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _show(value) -> str:
    if value is inspect.Parameter.empty:
        return "(required)"
    try:
        return toml_value(list(value) if isinstance(value, tuple) else value)
    except ValueError:
        return repr(value)


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_options(name: str, options: dict) -> None:
    """Option names against the signature; for built-in models, scalar values against their defaults' types."""
    known = model_options(name)
    if known is None:
        return
    allowed = ", ".join(f"{k} = {_show(v)}" for k, v in known.items()) or "(none)"
    unknown = sorted(set(options) - set(known))
    if unknown:
        if known:
            hint = str(unknown_name_error("option", unknown[0], known)).partition(" Known: ")[0].rstrip(";")
            hint += f"{' ' if hint.endswith('?') else '; '}allowed (with defaults): {allowed}"
        else:
            hint = f"model {name!r} takes no options"
        raise ValueError(f"model {name!r}: bad options {unknown} ({hint})")
    if is_import_path(name):
        return  # the user's factory checks its own values
    for key, value in options.items():
        want = type(known[key])
        ok = isinstance(value, want) and (want is bool or not isinstance(value, bool)) or (
            want is float and isinstance(value, int) and not isinstance(value, bool))
        if want in _TYPE_WORDS and not ok:
            raise ValueError(f"model option {key} must be {_TYPE_WORDS[want]} for model {name!r} "
                             f"(default {_show(known[key])}), got {value!r} ({type(value).__name__})")


def build_model(name: str, input_shape: Sequence[int], n_classes: int, **options) -> nn.Module:
    """The model ``name`` (registered, or ``"package.module:factory"``) for ``input_shape`` and ``n_classes``."""
    fn = _factory(name)
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or any(s < 1 for s in input_shape):
        raise ValueError(f"input_shape must be positive sizes, got {input_shape}")
    if not isinstance(n_classes, int) or n_classes < 2:
        raise ValueError(f"n_classes must be an integer >= 2, got {n_classes!r}")
    _check_options(name, options)
    try:
        model = fn(input_shape, n_classes, **options)
    except TypeError as e:
        raise ValueError(f"model {name!r}: building it with options {options} failed ({e})") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r}: the factory returned an object of type {type(model).__name__}; expected "
                         "a torch.nn.Module mapping (B, *input_shape) to (B, n_classes) logits")
    return model


#: a valid input shape for each model family, to check options before any data is loaded
_PROBE_SHAPES = {"lstm": (16, 2), "gru": (16, 2), "pgru": (16, 2), "gpt": (16,)}
_IMAGE_PROBE = (1, 28, 28)


def check_model_options(name: str, options: dict, *, input_shape: Sequence[int] | None = None,
                        n_classes: int = 2, sample: torch.Tensor | None = None) -> None:
    """Refuse an unknown model or options it does not take, before any output folder exists.

    Unknown option names are refused naming the allowed ones with their
    defaults (and the closest name); values are checked by building the
    model once, for ``input_shape`` and ``n_classes`` when given, else for a
    small input of its family (sequences for lstm/gru/pgru, 16 tokens for
    gpt, 1×28×28 images otherwise) and 2 classes. A model given as ``"package.module:factory"``
    is only built when ``input_shape`` is given (its inputs are its own),
    and then must map ``sample`` (or two zero inputs) to (B, n_classes)
    floating-point logits.

    >>> check_model_options("mlp", {"hiden": [32]})
    Traceback (most recent call last):
    ...
    ValueError: model 'mlp': bad options ['hiden'] (option 'hiden' is unknown; did you mean 'hidden'? ... [256, 128])
    """
    if input_shape is None and is_import_path(name):
        _check_options(name, options)
        return
    shape = tuple(input_shape) if input_shape is not None else _PROBE_SHAPES.get(name, _IMAGE_PROBE)
    model = build_model(name, shape, n_classes, **options)
    if not is_import_path(name):
        return
    x = sample if sample is not None else torch.zeros(2, *shape)
    if not any(True for _ in model.parameters()):
        raise ValueError(f"model {name!r}: the module has no parameters; there is nothing to train")
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except Exception as e:  # the user's forward pass: say which model and which inputs
        raise ValueError(f"model {name!r}: its forward pass on inputs of shape {tuple(x.shape)} failed "
                         f"({type(e).__name__}: {e})") from e
    want = (len(x), n_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or not out.is_floating_point():
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model {name!r}: for inputs of shape {tuple(x.shape)} the module returned {got}; "
                         f"expected floating-point logits of shape {want} (batch, n_classes)")


_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def vmap_blockers(module: nn.Module) -> list[str]:
    """Why agents of this model cannot be stacked under ``torch.vmap`` exactly.

    Dropout would draw from one shared stream instead of each agent's own, and
    buffers (batch norm statistics) are per agent. Empty list: vmap is exact.
    """
    reasons = []
    if any(isinstance(m, _DROPOUT) and m.p > 0 for m in module.modules()):
        reasons.append("it has dropout (each agent needs its own random stream)")
    if any(True for _ in module.buffers()):
        reasons.append("it has buffers such as batch-norm statistics (kept per agent)")
    if any(isinstance(m, (nn.RNNBase, SequenceClassifier)) for m in module.modules()):
        reasons.append("it is recurrent (each batch is cut to its own longest sequence: shapes vary per agent)")
    return reasons


def has_convolutions(module: nn.Module) -> bool:
    return any(isinstance(m, _CONV) for m in module.modules())


def n_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class SequenceClassifier(nn.Module):
    r"""A recurrent classifier for padded variable-length sequences.

    Input: (B, T, 1 + C), channel 0 a mask (1 at a sequence's valid steps,
    left-aligned; 0 at padding), channels 1..C the features (the sequence
    data sets' layout, :mod:`cdsgd.data.sequences`). The batch is first cut
    to its longest sequence (so a bucketed batch costs what its own lengths
    cost), then an LSTM or GRU runs over it and the hidden state after each
    sequence's own last step, h_{ℓ_i}, goes through a linear layer to logits.

    ``packed=True`` runs the recurrence through ``pack_padded_sequence``:
    padded steps are not computed at all. ``packed=False`` (the default) runs
    over the whole cut batch and picks h_{ℓ_i}: the padded steps are computed
    but cannot reach the output, so both give the same logits and gradients
    (to rounding). ``trim=False`` skips the cut: every batch runs over the
    data set's full padded length, the fixed-shape baseline bucketing is
    measured against. On CPU the padded form is the faster one, by far (the
    figures are in docs/benchmarks.md, from benchmarks/bucketing.py): there the
    cost follows the number of time steps, not of elements.

    >>> m = SequenceClassifier("lstm", (6, 3), 4, hidden=8)
    >>> x = torch.zeros(2, 6, 3); x[0, :6, 0] = 1; x[1, :2, 0] = 1
    >>> m(x).shape
    torch.Size([2, 4])
    """

    def __init__(self, cell: str, input_shape: Sequence[int], n_classes: int, *, hidden: int = 64,
                 layers: int = 1, packed: bool = False, trim: bool = True, mgrit: dict | None = None) -> None:
        super().__init__()
        if len(input_shape) != 2 or input_shape[1] < 2:
            raise ValueError(f"recurrent models need sequences of shape (T, 1 + C): a mask channel and C >= 1 "
                             f"features (plaid, japanese_vowels, synthetic_seq), got input_shape {tuple(input_shape)}")
        for key, value in (("hidden", hidden), ("layers", layers)):
            check_int(key, value, 1, what="model option ")
        for key, value in (("packed", packed), ("trim", trim)):
            if not isinstance(value, bool):
                raise ValueError(f"model option {key} must be true or false, got {value!r}")
        self.cell, self.packed, self.trim = cell, packed, trim
        if cell == "pgru":  # the implicit GRU of cdsgd.mgrit, serial or solved by MGRIT over time
            if layers != 1 or packed:
                raise ValueError(f"model 'pgru' is one layer and not packed, got layers={layers}, packed={packed}")
            self.rnn = ParallelGRU(input_shape[1] - 1, hidden, **(mgrit or {}))
        else:
            rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
            self.rnn = rnn(input_shape[1] - 1, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, n_classes)

    def _mgrit_padding(self, T: int) -> int:
        """Steps to add so that MGRIT's grids fit: T a multiple of m = cf^(levels−1), and at least 2m."""
        if self.cell != "pgru" or self.rnn.mode == "serial":
            return 0
        m = self.rnn.cf ** (self.rnn.levels - 1)
        return max(2 * m, -(-T // m) * m) - T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = sequence_lengths(x).clamp(min=1)
        feats = x[:, : int(lengths.max()), 1:] if self.trim else x[:, :, 1:]
        if self.packed:
            seq = nn.utils.rnn.pack_padded_sequence(feats, lengths.cpu(), batch_first=True, enforce_sorted=False)
            _, h = self.rnn(seq)
            last = (h[0] if isinstance(h, tuple) else h)[-1]  # the top layer's state after each sequence's end
        else:
            pad = self._mgrit_padding(feats.shape[1])
            if pad:  # steps after a sequence's end cannot reach its state at its end
                feats = nn.functional.pad(feats, (0, 0, 0, pad))
            out, _ = self.rnn(feats)
            last = out[torch.arange(len(x), device=x.device), lengths - 1]
        return self.head(last)


@MODELS.register("lstm")
def lstm(input_shape, n_classes, hidden: int = 64, layers: int = 1, packed: bool = False, trim: bool = True):
    return SequenceClassifier("lstm", input_shape, n_classes, hidden=hidden, layers=layers, packed=packed, trim=trim)


@MODELS.register("pgru")
def pgru(input_shape, n_classes, hidden: int = 64, mode: str = "mgrit", cf: int = 8, levels: int = 2, iters: int = 4,
         fcf: bool = True, rtol: float | None = 1e-3, fallback: bool = True, coarse: str = "frozen",
         trim: bool = True):
    """The implicit GRU of Moon & Cyr (cdsgd.mgrit.ParallelGRU): ``mode`` "serial" or "mgrit" (docs/parallel-in-time.md).

    ``rtol = 0`` (with ``fallback = false``) runs exactly ``iters`` V-cycles, as before the tolerance existed.
    """
    return SequenceClassifier("pgru", input_shape, n_classes, hidden=hidden, trim=trim,
                              mgrit={"mode": mode, "cf": cf, "levels": levels, "iters": iters, "fcf": fcf,
                                     "rtol": None if rtol == 0 else rtol, "fallback": fallback, "coarse": coarse})


@MODELS.register("gru")
def gru(input_shape, n_classes, hidden: int = 64, layers: int = 1, packed: bool = False, trim: bool = True):
    return SequenceClassifier("gru", input_shape, n_classes, hidden=hidden, layers=layers, packed=packed, trim=trim)


MODELS.register("gpt")(gpt)
