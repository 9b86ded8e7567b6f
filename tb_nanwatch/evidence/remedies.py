"""The remedy catalogue: what to try against a cause, and when it applies.

Each :class:`Remedy` has an id (the tab's vocabulary, :data:`REMEDY_LABELS`),
a short label, a text (a function of the :class:`Facts` of the verdict, so it
can quote the numbers of the run: the learning rate at the step, the variable
that was non-finite) and a test of when it applies, read from recorded facts
(the run summary's ``loss_from_logits``, ``dtype_policy``, ``optimizer``,
``optimizer_settings``, ``has_attention``; the incident's op; the scale of each
model input and target; the verdict's evidence). A remedy that does not apply
is never offered.

Each entry also declares what its trial changes, as data from the vocabulary
of :mod:`tb_nanwatch.evidence.changes` (``trial``; None: advice, never tried),
and whether that change can be set on a running optimizer (``live``: what
``on_nonfinite="rewind"`` sets after a rewind). The record side reads the
change, never the id (``record/after_incident/trial_remedies.py`` for the
trials, ``live_remedies.py`` for a live run).

The cause engine (:mod:`tb_nanwatch.evidence.causes`) names remedies by id in
its rule table, ranked, each with the condition under which that cause offers
it; this module owns the wording and the change. A new remedy is one
:class:`Remedy` entry in :data:`CATALOGUE`.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

from tb_nanwatch.evidence import changes
from tb_nanwatch.evidence.trials import Trial, combined_id

# Optimizers without an epsilon in their update (type names as recorded), for
# runs that did not record the optimizer's settings.
NO_EPSILON = frozenset({"SGD", "Lion"})
# The gradient norm clip_gradients proposes (and its trial sets); an optimizer
# already clipping at or below it is not told to clip.
CLIP_NORM = 1.0
# A model input or target whose largest |x| reaches this is far from unit scale.
FAR_FROM_UNIT = 50.0
# Layer class or path words that make a model one with attention (or a masked
# softmax): only then is masking advice given.
ATTENTION_WORDS = ("attention", "attend", "mask", "softmax")
# Final activations whose outputs are probabilities (the run summary's
# ``output_activations``).
PROBABILITY_ACTIVATIONS = frozenset({"softmax", "sigmoid", "log_softmax"})
# Layer classes that, first in a model, put its inputs at unit scale.
NORMALIZING_LAYERS = frozenset(
    {"Normalization", "Rescaling", "BatchNormalization", "LayerNormalization"}
)
# Words of a loss's recorded name (``loss_name``) that make it a
# classification loss: its targets are labels (class or token ids), never
# values whose scale matters.
CLASSIFICATION_LOSS_WORDS = (
    "crossentropy",
    "entropy",
    "categorical",
    "sparse",
    "nll",
    "likelihood",
    "hinge",
    "kl_div",
    "kldiv",
    "token",
    "class",
    "label",
)
# Words of a loss's recorded name that make it a regression loss (its
# targets are values, even whole ones).
REGRESSION_LOSS_WORDS = ("squared", "absolute", "mse", "mae", "huber", "cosh", "mape", "msle")
RESCALE_FLOAT64 = "Rescale float64 data before casting to float32: values beyond 3.4e38 become Inf."


def fmt(value: float | None, digits: int = 3) -> str:
    """A number as the texts quote it (``digits`` significant digits; ``?`` unknown)."""
    return "?" if value is None else f"{value:.{digits}g}"


@dataclasses.dataclass(frozen=True)
class DataScale:
    """The recorded range of one model input or target (over the recorded
    steps up to the incident)."""

    name: str  # the entry's name: the input's, "target" or "target/<output>"
    words: str  # how the texts name it ("the model input", "model input 'price'")
    low: float
    high: float
    target: bool
    # Why its range is no scale evidence (None: it is): "class ids" (integer
    # targets of a classification loss), "normalised by the model" (an input
    # whose model starts with a Normalization).
    not_scale: str | None = None

    @property
    def max_abs(self) -> float:
        return max(abs(self.low), abs(self.high))

    @property
    def far(self) -> bool:
        """Far from unit scale (see :data:`FAR_FROM_UNIT`); never class or
        token ids, never an input the model normalises itself."""
        return self.not_scale is None and self.max_abs >= FAR_FROM_UNIT

    @property
    def integral(self) -> bool:
        """Both bounds whole numbers, none negative (what class ids look like)."""
        return self.low >= 0 and float(self.low).is_integer() and float(self.high).is_integer()

    def text(self) -> str:
        """e.g. ``the model input ranges 510 to 1.92e+04``."""
        return f"{self.words} ranges {fmt(self.low)} to {fmt(self.high)}"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a remedy reads: the verdict and the recorded facts of the run."""

    cause: str  # the verdict's cause id
    evidence: Mapping  # the verdict's evidence (unknown items left out)
    summary: Mapping  # the run summary
    mixed_precision: bool = False  # a float16 policy, or a loss scale recorded
    outputs_probabilities: bool = False  # a model output ends in sigmoid/softmax
    incident: Mapping = dataclasses.field(default_factory=dict)  # {} without one
    scales: tuple[DataScale, ...] = ()  # each model input's and target's range
    layers: tuple[str, ...] = ()  # the recorded layer paths

    @property
    def reads_probabilities(self) -> bool:
        """The loss reads probabilities: a sigmoid/softmax output, or a
        cross-entropy recorded as reading probabilities (never a from-logits loss)."""
        if self.loss_from_logits is True:
            return False
        return self.outputs_probabilities or self.loss_from_logits is False

    def far(self, target: bool) -> list[DataScale]:
        """The model inputs (or the targets) far from unit scale, largest first."""
        found = [s for s in self.scales if s.target == target and s.far]
        return sorted(found, key=lambda s: -s.max_abs)

    @property
    def normalizes_inputs(self) -> bool:
        """The model's first layer normalises its inputs (recorded
        ``normalizes_inputs`` or ``first_layer_class``)."""
        return normalizes_inputs(self.summary)

    @property
    def outputs_end_in_probabilities(self) -> bool:
        """The outputs already end in a sigmoid/softmax (recorded before a final
        activation, or the run summary's ``output_activations``)."""
        return self.outputs_probabilities or outputs_activated(self.summary)

    @property
    def loss_name(self) -> str | None:
        value = self.summary.get("loss_name")
        return value if isinstance(value, str) else None

    @property
    def op(self) -> str | None:
        """The op the replay named for the incident (``Square
        (compile_loss/mse/Square)``), None when none is named."""
        op = self.incident.get("op")
        if not isinstance(op, dict):
            return None
        kind, name = op.get("type"), op.get("name")
        kind = kind if isinstance(kind, str) and kind else None
        name = name if isinstance(name, str) and name else None
        if not (kind or name):
            return None
        source = op.get("source")
        at = f" at {source}" if isinstance(source, str) and source else ""
        return f"{kind or 'op'}" + (f" ({name})" if name else "") + at

    @property
    def has_attention(self) -> bool:
        """An attention layer (or a layer named for a mask or a softmax)."""
        if self.summary.get("has_attention") is True:
            return True
        classes = self.summary.get("layer_classes")
        names = [*self.layers, *(classes if isinstance(classes, list) else [])]
        return any(w in str(n).lower() for n in names for w in ATTENTION_WORDS)

    def setting(self, name: str) -> float | None | bool:
        """An optimizer setting as recorded (``optimizer_settings``): a number,
        None (the optimizer has none), or False (not recorded)."""
        settings = self.summary.get("optimizer_settings")
        if not isinstance(settings, dict) or name not in settings:
            return False
        value = settings[name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if number and math.isfinite(value) else None

    @property
    def loss_from_logits(self) -> bool | None:
        """Whether the loss reads logits (None: not recorded or not known)."""
        value = self.summary.get("loss_from_logits")
        return value if isinstance(value, bool) else None

    @property
    def optimizer(self) -> str | None:
        value = self.summary.get("optimizer")
        return value if isinstance(value, str) else None

    @property
    def clip_norm(self) -> float | None:
        """The norm the optimizer already clips at (clipnorm or
        global_clipnorm, the smaller), None when it does not or not recorded."""
        norms = [self.setting(n) for n in ("clipnorm", "global_clipnorm")]
        norms = [n for n in norms if isinstance(n, float) and n > 0]
        return min(norms) if norms else None

    @property
    def has_epsilon(self) -> bool:
        """The optimizer has an epsilon (recorded; else judged by its type name)."""
        epsilon = self.setting("epsilon")
        if epsilon is False:
            return self.optimizer not in NO_EPSILON
        return epsilon is not None

    def number(self, name: str) -> float | None:
        """An evidence item that is a finite number, else None."""
        value = self.evidence.get(name)
        finite = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if finite and math.isfinite(value) else None


def normalizes_inputs(summary: Mapping) -> bool:
    """Whether the run summary says the model's first layer normalises its inputs."""
    if summary.get("normalizes_inputs") is True:
        return True
    return summary.get("first_layer_class") in NORMALIZING_LAYERS


def outputs_activated(summary: Mapping) -> bool:
    """Whether the run summary says every model output ends in a sigmoid/softmax."""
    found = summary.get("output_activations")
    if not isinstance(found, list) or not found:
        return False
    return all(isinstance(a, str) and a.lower() in PROBABILITY_ACTIVATIONS for a in found)


def classification_loss(summary: Mapping) -> bool:
    """Whether the loss takes labels: a cross-entropy (``loss_from_logits``
    recorded either way) or a loss whose name says so (``loss_name``)."""
    if isinstance(summary.get("loss_from_logits"), bool):
        return True
    name = summary.get("loss_name")
    return isinstance(name, str) and any(w in name.lower() for w in CLASSIFICATION_LOSS_WORDS)


def regression_loss(summary: Mapping) -> bool:
    """Whether the loss's recorded name (``loss_name``) is a regression loss's."""
    name = summary.get("loss_name")
    return isinstance(name, str) and any(w in name.lower() for w in REGRESSION_LOSS_WORDS)


@dataclasses.dataclass(frozen=True)
class Remedy:
    """One remedy: its id, short label, text and when it applies; what its
    trial changes (``trial``: a change of :mod:`tb_nanwatch.evidence.changes`,
    None for advice) and whether a running optimizer can take that change
    (``live``)."""

    id: str
    label: str
    text: Callable[[Facts], str]
    applies: Callable[[Facts], bool] = lambda facts: True
    trial: changes.Change | None = None
    live: bool = False
    # The code to paste that does what the trial did, with the trial's numbers
    # (the factor found, the held rate): ``code(facts, trial)``, trial None when
    # not tried; None: no code (advice).
    code: Callable[[Facts, Trial | None], str | None] | None = None

    def code_for(self, facts: Facts, trial: Trial | None) -> str | None:
        """This remedy's code on ``facts`` with ``trial``'s numbers (None: none,
        or a Keras snippet for a run without a Keras model: a TF1 graph's)."""
        code = None if self.code is None else self.code(facts, trial)
        if code and facts.summary.get("loop") == "graph" and "keras" in code:
            return None
        return code


# -- the texts ------------------------------------------------------------------


def _lower_lr(f: Facts) -> str:
    lr, step = f.number("lr"), f.evidence.get("onset_step", f.evidence.get("step"))
    was = f" (it was {fmt(lr)} at step {step})" if lr is not None else ""
    calm = (
        ", or add label smoothing: the logits grew to saturation"
        if f.evidence.get("saturated") is True
        else ""
    )
    return f"Lower the learning rate{was}, e.g. 10x{calm}."


def _fix_schedule(f: Facts) -> str:
    return (
        f"Fix the learning-rate schedule: {fmt(f.number('lr'))} at this step vs "
        f"{fmt(f.number('lr_before'))}."
    )


def _normalize_inputs(f: Facts) -> str:
    if f.cause == "input_data":
        return RESCALE_FLOAT64
    far = f.far(target=False)
    seen = "; ".join(scale.text() for scale in far[:3])
    if f.mixed_precision:
        return (
            f"Normalise the inputs ({seen}) so that values stay well below float16's 65504."
            if far
            else "Normalise inputs and activations so values stay well below 65504."
        )
    return (
        f"Normalise the inputs: {seen}. Put a keras.layers.Normalization first in the model "
        "and adapt it on the training data (norm = keras.layers.Normalization(); "
        "norm.adapt(x_train)), so each feature has mean 0 and variance 1."
    )


def probability_activation(f: Facts) -> str:
    """The activation the outputs lack (:func:`expected_activation` of the
    recorded loss name and output units)."""
    return expected_activation(f.loss_name, f.summary.get("output_units"))


def expected_activation(loss: str | None, output_units: object) -> str:
    """The activation a loss that reads probabilities expects of raw outputs:
    sigmoid for a binary loss or when every output has one unit (a softmax
    over one unit is always 1), else softmax. The card and the trial both
    decide with this."""
    name = (loss or "").lower()
    if "binary" in name or "sigmoid" in name:
        return "sigmoid"
    units = output_units if isinstance(output_units, list) else []
    return "sigmoid" if units and all(u == 1 for u in units) else "softmax"


def loss_name(loss: object) -> str | None:
    """The loss by name: a loss object's class, a function's name, a string
    as given; None for several differing losses or none."""
    if isinstance(loss, (list, tuple, dict)):
        items = loss.values() if isinstance(loss, dict) else loss
        names = {loss_name(item) for item in items}
        return names.pop() if len(names) == 1 else None
    if isinstance(loss, str):
        return loss
    if loss is None:
        return None
    name = getattr(loss, "__name__", None) or type(loss).__name__
    return str(name)[:100]


def _output_activation(f: Facts) -> str:
    act = probability_activation(f)
    low, high = f.number("output_min"), f.number("output_max")
    seen = (
        f" (its outputs ranged {fmt(low)} to {fmt(high)} at step {f.evidence.get('first_step')})"
        if low is not None and high is not None
        else ""
    )
    loss = f.loss_name if f.loss_name and f.loss_name[:1].isupper() else None
    loss = loss or ("BinaryCrossentropy" if act == "sigmoid" else "SparseCategoricalCrossentropy")
    return (
        f"The loss takes the log of probabilities but the model outputs raw logits{seen}: "
        f'add the {act} on the outputs (the last layer keras.layers.Dense(n, activation="{act}"), '
        f'or outputs = keras.layers.Activation("{act}")(logits)), or keep the logits and '
        f"compute the loss from them: loss=keras.losses.{loss}(from_logits=True)."
    )


def _scale_targets(f: Facts) -> str:
    if f.cause == "input_data":
        return RESCALE_FLOAT64
    far = f.far(target=True)
    seen = "; ".join(scale.text() for scale in far[:3]) or "the targets are large"
    return (
        f"Standardise the targets: {seen}. Train on (y - y.mean()) / y.std() and map the "
        "predictions back (y_pred * std + mean), so the loss starts near 1."
    )


def _clip_gradients(f: Facts) -> str:
    clip = f.clip_norm
    if clip is not None:
        return f"Clip gradients harder: the optimizer clips at {fmt(clip)}; try {CLIP_NORM!r}."
    return (
        f"Clip gradients: clipnorm={CLIP_NORM!r} or global_clipnorm={CLIP_NORM!r} in the optimizer."
    )


def _raise_epsilon(f: Facts) -> str:
    epsilon = f.setting("epsilon")
    now = f" (it is {fmt(epsilon)})" if isinstance(epsilon, float) else ""
    return f"Raise the optimizer's epsilon{now} (Adam/RMSprop: 1e-7 -> 1e-4; never 0)."


def _drop_bad_rows(f: Facts) -> str:
    rows = f.evidence.get("rows")
    first = rows[0].get("rows") if isinstance(rows, list) and rows else None
    start = f", starting with rows {first} of this batch" if first else ""
    return (
        "Find the bad records: tf.debugging.assert_all_finite (or np.isfinite) over the "
        f"dataset{start}; fill or drop missing values in preprocessing and guard its "
        "divisions and logs."
    )


def _fix_weights(f: Facts) -> str:
    variables = f.evidence.get("variables")
    which = f" ({variables[0]} is non-finite before training)" if variables else ""
    return (
        f"Reload the checkpoint or pretrained weights from a clean copy{which}, or replace "
        "the non-finite entries before fit (e.g. np.nan_to_num on an embedding table, or "
        "re-initialise the variable)."
    )


_REPLAY = "tf.debugging.enable_check_numerics() to name the op"
_SAFE_OPS = (
    "add an epsilon (log(x + 1e-7), x / (y + 1e-7)), clamp (tf.maximum(x, 0.)) or use "
    "safe ops (tf.math.divide_no_nan, tf.math.xlogy, tf.nn.log_softmax)"
)
_MASK = (
    "mask attention with a large finite negative (-1e9), not -inf (an all-masked row gives "
    "a softmax of 0/0)"
)


def _named_op(f: Facts) -> str:
    """Where the op is: the replay's name for it, or how to find it."""
    if f.op is not None:
        return f"the replay named the op: {f.op}"
    return f"replay the step eagerly under {_REPLAY}"


def _fix_code(f: Facts) -> str:
    layer = f.evidence.get("layer")
    if f.cause == "nonfinite_weights":
        return "If no weights were loaded, check the variable's initializer."
    if f.cause == "forward_math":
        mask = f"; {_MASK}" if f.has_attention else ""
        return (
            f"Look in {layer} for log or sqrt of a negative or zero, 0/0 or a division by ~0: "
            f"{_SAFE_OPS}{mask}; {_named_op(f)}."
        )
    if f.cause == "backward_math":
        return (
            f"Add an epsilon inside sqrt/log/pow in {layer} (sqrt(x + 1e-12)) or clip its "
            "input away from 0; check any tf.custom_gradient in the layer."
        )
    if f.cause == "loss_math" and f.loss_from_logits is True:
        return (
            "Check the loss function: it reads logits and still broke on finite predictions "
            "(a hand-written term with log, sqrt or a division at 0, or targets out of range)."
        )
    if f.cause == "loss_math":
        return (
            "Check the loss function: the predictions were finite and the loss was not (a "
            "hand-written log, sqrt or division at 0, a square of a value beyond 1.8e19, or "
            f"targets out of range); {_named_op(f)}."
        )
    return (
        "Open the step table of the incident and the steps before it (look for values that "
        "grew or sat at a limit); "
        + (
            _named_op(f)
            if f.op is not None
            else f"replay the step from the reproduction bundle eagerly under {_REPLAY}"
        )
        + "."
    )


def _text(sentence: str) -> Callable[[Facts], str]:
    return lambda facts: sentence


# -- the code to paste (what each trial did, with its numbers) ---------------------


def _optimizer_name(f: Facts) -> str:
    name = f.optimizer or "Adam"
    return "Adam" if name == "LossScaleOptimizer" else name


def _rate_number(f: Facts) -> float | None:
    """The rate the run had at the step: the verdict's ``lr``, else the recorded setting."""
    lr = f.number("lr")
    if lr is None:
        setting = f.setting("learning_rate")
        lr = setting if isinstance(setting, float) else None
    return lr


def found_factor(trial: Trial | None) -> float | None:
    """The rate factor a ``lower_lr`` trial found (``lr x0.01`` -> 0.01); None
    when the trial did not fix the run."""
    if trial is None or trial.outcome != "fixed":
        return None
    match = re.search(r"lr x([0-9.eE+-]+)", trial.setting)
    return float(match.group(1)) if match else None


def _lower_lr_code(f: Facts, trial: Trial | None) -> str:
    factor = found_factor(trial) or 0.1
    lr = _rate_number(f)
    if lr is None:
        return f"optimizer.learning_rate = optimizer.learning_rate * {factor:g}"
    rate = f"{lr * factor:.4g}"
    return (
        f"optimizer.learning_rate = {rate}  # was {fmt(lr, 4)}: x{factor:g}, as the trial\n"
        f"# or, where you build it: keras.optimizers.{_optimizer_name(f)}(learning_rate={rate})"
    )


def held_rate(f: Facts, trial: Trial | None) -> float | None:
    """The rate a ``fix_schedule`` trial held: the verdict's ``lr_before``,
    else the one its setting names (``lr held at 0.001``)."""
    before = f.number("lr_before")
    if before is not None:
        return before
    match = re.search(r"held at ([0-9.eE+-]+)", trial.setting if trial else "")
    return float(match.group(1)) if match else None


def _fix_schedule_code(f: Facts, trial: Trial | None) -> str | None:
    held = held_rate(f, trial)
    if held is None:
        return None
    rate = f"{held:.4g}"
    return (
        f"optimizer.learning_rate = {rate}  # held at the rate before the jump, as the trial\n"
        f"# or, where you build it: keras.optimizers.{_optimizer_name(f)}(learning_rate={rate})"
    )


def _clip_code(f: Facts, trial: Trial | None) -> str:
    return f"keras.optimizers.{_optimizer_name(f)}(..., clipnorm={CLIP_NORM!r})"


def _epsilon_code(f: Facts, trial: Trial | None) -> str:
    return f"keras.optimizers.{_optimizer_name(f)}(..., epsilon=1e-4)"


def _normalize_code(f: Facts, trial: Trial | None) -> str | None:
    if f.cause == "input_data":
        return None
    return (
        "norm = keras.layers.Normalization()  # first in the model\n"
        "norm.adapt(x_train)\n"
        "inputs = keras.Input(shape=x_train.shape[1:])\n"
        "x = norm(inputs)  # then the model's layers on x"
    )


def _scale_targets_code(f: Facts, trial: Trial | None) -> str | None:
    if f.cause == "input_data":
        return None
    return (
        "y_mean, y_std = y_train.mean(axis=0), y_train.std(axis=0)\n"
        "y_train = (y_train - y_mean) / y_std  # predictions: y_pred * y_std + y_mean"
    )


def _output_activation_code(f: Facts, trial: Trial | None) -> str:
    return f'outputs = keras.layers.Activation("{probability_activation(f)}")(logits)'


def _from_logits_code(f: Facts, trial: Trial | None) -> str:
    loss = f.loss_name if f.loss_name and f.loss_name[:1].isupper() else "CategoricalCrossentropy"
    return f"loss=keras.losses.{loss}(from_logits=True)  # and no final sigmoid/softmax"


def _clip_predictions_code(f: Facts, trial: Trial | None) -> str:
    return "y_pred = keras.ops.clip(y_pred, 1e-7, 1 - 1e-7)  # before the log"


def _float32_policy_code(f: Facts, trial: Trial | None) -> str:
    return 'keras.mixed_precision.set_global_policy("float32")  # before building the model'


def overflow_layer(f: Facts) -> str | None:
    """The layer (its path) that overflowed: the verdict's, else the incident's."""
    for value in (f.evidence.get("layer"), f.incident.get("layer")):
        if isinstance(value, str) and value:
            return value
    return None


def _float32_layer(f: Facts) -> str:
    layer = overflow_layer(f)
    return (
        f"Run the layer {layer} in float32: under mixed precision its values went past "
        "float16's 65504. Give that one layer dtype='float32' where you build it; the "
        "rest stays in mixed precision."
    )


def _float32_layer_code(f: Facts, trial: Trial | None) -> str:
    layer = overflow_layer(f)
    return f'keras.layers.X(..., dtype="float32")  # X: the class of the layer {layer!r}'


def _drop_rows_code(f: Facts, trial: Trial | None) -> str:
    return (
        "rows = len(x_train)\n"
        "keep = np.isfinite(x_train.reshape(rows, -1)).all(axis=1)\n"
        "keep &= np.isfinite(y_train.reshape(rows, -1)).all(axis=1)\n"
        "x_train, y_train = x_train[keep], y_train[keep]"
    )


def _warmup_code(f: Facts, trial: Trial | None) -> str:
    match = re.search(r"\((\d+) steps\)", trial.setting if trial else "")
    steps = match.group(1) if match else "100"
    lr = _rate_number(f)
    target = f"{lr:.4g}" if lr is not None else "learning_rate"
    return (
        f"keras.optimizers.schedules.CosineDecay(0.0, decay_steps=10**9, "
        f"warmup_target={target}, warmup_steps={steps})"
    )


# -- the catalogue --------------------------------------------------------------

CATALOGUE: dict[str, Remedy] = {
    remedy.id: remedy
    for remedy in (
        Remedy(
            "lower_lr",
            "Lower the learning rate",
            _lower_lr,
            applies=lambda f: f.evidence.get("lr") != 0,  # a rate of 0 cannot be lowered
            trial=changes.ScaleRate(factors=(10, 100, 1000)),
            live=True,
            code=_lower_lr_code,
        ),
        Remedy(
            "fix_schedule",
            "Fix the learning-rate schedule",
            _fix_schedule,
            applies=lambda f: f.number("lr") is not None and f.number("lr_before") is not None,
            trial=changes.HoldRate(),
            live=True,
            code=_fix_schedule_code,
        ),
        Remedy(
            "clip_gradients",
            "Clip gradients",
            _clip_gradients,
            # An optimizer that already clips at this norm gains nothing from it.
            applies=lambda f: f.clip_norm is None or f.clip_norm > CLIP_NORM,
            trial=changes.OptimizerSettings((("clipnorm", CLIP_NORM), ("global_clipnorm", None))),
            live=True,
            code=_clip_code,
        ),
        Remedy(
            "raise_epsilon",
            "Raise the optimizer's epsilon",
            _raise_epsilon,
            applies=lambda f: f.has_epsilon,
            trial=changes.OptimizerSettings((("epsilon", 1e-4),)),
            live=True,
            code=_epsilon_code,
        ),
        Remedy(
            "from_logits",
            "Compute the loss from logits",
            _text("Compute the loss from logits (from_logits=True, no final activation)."),
            applies=lambda f: f.reads_probabilities,
            trial=changes.FromLogits(),
            code=_from_logits_code,
        ),
        Remedy(
            "output_activation",
            "Add the softmax/sigmoid on the outputs",
            _output_activation,
            # Raw outputs fed to a loss that reads probabilities; never to
            # outputs that already end in a sigmoid/softmax.
            applies=lambda f: f.loss_from_logits is not True and not f.outputs_end_in_probabilities,
            trial=changes.OutputActivation(),
            code=_output_activation_code,
        ),
        Remedy(
            "clip_predictions",
            "Clip predictions before the log",
            _text(
                "In a hand-written cross-entropy, clip the predictions to [1e-7, 1 - 1e-7] "
                "before the log (rather than log(p + eps))."
            ),
            applies=lambda f: f.reads_probabilities,
            trial=changes.ClipPredictions(low=1e-7, high=1.0 - 1e-7),
            code=_clip_predictions_code,
        ),
        Remedy(
            "float32_policy",
            "Keep large layers in float32",
            _text(
                "Keep the layers with large outputs or gradients in float32 (dtype='float32', "
                "e.g. the final softmax or a normalisation), or use bfloat16 (float32's range) "
                "where the hardware supports it."
            ),
            applies=lambda f: f.mixed_precision,
            trial=changes.Float32Policy(),
            code=_float32_policy_code,
        ),
        Remedy(
            "float32_layer",
            "Run the overflowing layer in float32",
            _float32_layer,
            # Under mixed precision, when the layer that overflowed is named.
            applies=lambda f: f.mixed_precision and overflow_layer(f) is not None,
            trial=changes.Float32Layer(),
            code=_float32_layer_code,
        ),
        Remedy(
            "normalize_inputs",
            "Normalise the inputs",
            _normalize_inputs,
            # Only on scale evidence: an Inf in the data, or an input far from unit scale.
            # Never to a model whose first layer already normalises its inputs.
            applies=lambda f: (
                f.cause == "input_data" or (bool(f.far(target=False)) and not f.normalizes_inputs)
            ),
            trial=changes.DataTransform("normalise_inputs", partner="scale_targets"),
            code=_normalize_code,
        ),
        Remedy(
            "scale_targets",
            "Scale the targets",
            _scale_targets,
            # A loss that reads logits or probabilities takes labels, not values to scale.
            applies=lambda f: (
                f.loss_from_logits is None and (f.cause == "input_data" or bool(f.far(target=True)))
            ),
            trial=changes.DataTransform("standardise_targets", partner="normalize_inputs"),
            code=_scale_targets_code,
        ),
        Remedy(
            "drop_bad_rows",
            "Find and drop the bad rows",
            _drop_bad_rows,
            trial=changes.DataTransform("drop_nonfinite_rows"),
            code=_drop_rows_code,
        ),
        Remedy(
            "lr_warmup",
            "Warm up the learning rate",
            _text("Add a learning-rate warm-up over the first steps."),
            trial=changes.WarmUp(),
            code=_warmup_code,
        ),
        Remedy("fix_weights", "Restore clean weights", _fix_weights),  # advice: no trial
        Remedy("fix_code", "Fix the op in the code", _fix_code),  # advice: no trial
    )
}
REMEDY_IDS = tuple(CATALOGUE)


def _lead(text: str, label: str) -> tuple[str, str]:
    """A remedy text's lead (before its first colon) and the rest."""
    lead, colon, rest = text.partition(": ")
    return (lead, rest) if colon else (label, text)


def combination(ids: Sequence[str], facts: Sequence[Facts], trial: Trial | None) -> dict:
    """A combination of remedies as one remedy: ``{"id", "text", "code"}``,
    its text both texts joined ("Normalise the inputs and standardise the
    targets: ..."), its code both codes, in order."""
    leads, rests, codes = [], [], []
    for i, (remedy, f) in enumerate(zip(ids, facts, strict=True)):
        entry = CATALOGUE[remedy]
        lead, rest = _lead(entry.text(f), entry.label)
        leads.append(lead if i == 0 else lead[:1].lower() + lead[1:])
        rests.append(rest)
        code = entry.code_for(f, trial)
        if code:
            codes.append(code)
    text = f"{' and '.join(leads)} (together: each alone did not fix the run): {' '.join(rests)}"
    return {"id": combined_id(ids), "text": text, "code": "\n".join(codes) or None}


# A short label for each remedy id (the tab's vocabulary).
REMEDY_LABELS = {remedy.id: remedy.label for remedy in CATALOGUE.values()}
