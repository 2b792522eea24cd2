"""The training problems in a reproducible order, and the position in it that every checkpoint saves."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from .config import TrainConfig
from .data import DataError, Problem, load_problems
from .embedded.synthetic import problems as synthetic_problems


class ProblemStream:
    """Training problems in a reproducible order; its position is saved with every checkpoint."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.position = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) of the current epoch
        if cfg.data.train == "synthetic":
            self._items = None
            self._stream = self._synthetic()
        else:
            d = cfg.data
            self._items = load_problems(
                str(Path(d.train).expanduser()), problem_field=d.problem_field, answer_field=d.answer_field
            )

    def _synthetic(self):
        """The embedded task's training stream from its start (``data.levels``, ``data.level_weights``)."""
        d = self.cfg.data
        return synthetic_problems("train", levels=d.levels, seed=self.cfg.seed, weights=d.level_weights)

    def drop_long_prompts(self, prompt_tokens, budget: int) -> int:
        """Remove problems whose prompt is longer than ``budget`` tokens; returns how many."""
        if self._items is None:
            return 0
        keep = [p for p in self._items if prompt_tokens(p) <= budget]
        if not keep:
            raise DataError(
                f"{self.cfg.data.train}: every prompt is longer than {budget} tokens (data.max_prompt_tokens)"
            )
        dropped, self._items = len(self._items) - len(keep), keep
        return dropped

    def take(self, n: int) -> list[Problem]:
        if self._items is None:
            out = [Problem(p.problem, p.answer, p.level) for p in itertools.islice(self._stream, n)]
        else:  # epochs over the set, each in its own seeded order
            out = []
            for pos in range(self.position, self.position + n):
                epoch, i = divmod(pos, len(self._items))
                if self._order is None or self._order[0] != epoch:
                    order = list(range(len(self._items)))
                    random.Random(f"{self.cfg.seed}-{epoch}").shuffle(order)
                    self._order = (epoch, order)
                out.append(self._items[self._order[1][i]])
        self.position += n
        return out

    def seek(self, position: int) -> None:
        if self._items is None:
            self._stream = self._synthetic()
            for _ in itertools.islice(self._stream, position):
                pass
        self.position = position
