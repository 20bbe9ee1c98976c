"""Built-in tasks: each is a data source (`data: {source: builtin:<name>}`), a reward
(`fn: builtin:<name>`) and, for multi-turn tasks, a workflow (`workflow: builtin:<name>`).

Every source is a pure function of (seed, split, step, index); `split: eval` (or `eval_sample(i)`)
gives held-out problems that the train split never draws.
"""

from flowrl_operators.tasks.calculator import CalculatorEnv, calculator
from flowrl_operators.tasks.code_arith import code_arith
from flowrl_operators.tasks.digits import copy_digits, positions_correct, reverse_digits
from flowrl_operators.tasks.grid_nav import GridNavEnv, grid_nav
from flowrl_operators.tasks.guess import GuessNumberEnv, guess_number
from flowrl_operators.tasks.longtail import longtail_digits

# The built-ins, each registered in the entry-point group flowrl.tasks (pyproject.toml), as a plugin's would be.
TASKS = {t.name: t for t in (reverse_digits, copy_digits, guess_number, calculator, grid_nav, longtail_digits,
                                code_arith)}

__all__ = ["TASKS", "CalculatorEnv", "GridNavEnv", "GuessNumberEnv", "calculator", "code_arith", "copy_digits", "grid_nav",
           "guess_number", "longtail_digits", "positions_correct", "reverse_digits"]
