"""GRPO's reward: the Python function ``grpo.reward`` names ("package.module:function"), called once per
completion as ``function(prompt=..., completion=..., **fields)``.

The function is user code run on every completion, so its failures are data, not crashes: a call that raises,
or returns anything but a finite real number (a bool counts as 0 or 1), gives that completion reward 0 and is
counted (``reward_errors`` in the metrics); the first such failure of a run is logged with the exception and
the prompt's line. Importing it happens when the run starts: a name that does not resolve to a callable is a
one-line ``ConfigError``.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Callable

from mmtrain.config.loader import ConfigError
from mmtrain.utils.log import get_logger


def load_reward(spec: str) -> Callable[..., object]:
    """The callable ``spec`` ("package.module:function") names; ``ConfigError`` naming what failed otherwise."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure of user code at import is the same one-line error
        raise ConfigError(f"grpo.reward={spec}: cannot import {module_name} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"grpo.reward={spec}: {module_name} has no function {name}")
    return fn


class RewardScorer:
    """Scores completions with the reward function; ``errors`` counts the failed calls of the run so far."""

    def __init__(self, fn: Callable[..., object], spec: str, prompts_file: str) -> None:
        self.fn, self.spec, self.prompts_file = fn, spec, prompts_file
        self.errors = 0

    def score(self, prompt: str, completion: str, fields: dict, line: int) -> tuple[float, bool]:
        """(reward, whether the call failed): a failure's reward is 0."""
        try:
            value = self.fn(prompt=prompt, completion=completion, **fields)
            problem = None if _is_finite_real(value) else f"returned {_shown(value)}, not a finite number"
        except Exception as exc:  # noqa: BLE001 - a reward function's failure is that completion's reward 0
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem is None:
            return float(value), False
        if self.errors == 0:
            get_logger("train").warning(
                f"grpo.reward={self.spec} {problem} for the prompt of {self.prompts_file} line {line}; that "
                "completion gets reward 0, and every such failure is counted in reward_errors")
        self.errors += 1
        return 0.0, True


def _is_finite_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
