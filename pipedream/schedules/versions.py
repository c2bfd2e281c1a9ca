"""Which weight versions an action table needs, and which of them must be copies (pure).

Version ``v`` is the stage's weights after ``v`` updates. It is created by an update and
replaced by the next one; a forward or backward that uses it after that next update needs it
to be a *copy* (weight stashing), otherwise it can alias the live parameters. Both the runtime
(:class:`~pipedream.runtime.weight_versions.WeightVersions`) and the simulator (which charges the
copy to the update that creates it) read this from the table. No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipedream.schedules.actions import Action, Op

__all__ = ["VersionUse", "version_use"]


@dataclass(frozen=True)
class VersionUse:
    """When each version of a table is last used and when it is replaced."""

    last_use: dict[int, int]
    """Version -> position of the last action that uses it."""
    replaced_at: dict[int, int]
    """Version -> position of the update that replaces it (absent: never replaced)."""

    def needs_copy(self, version: int) -> bool:
        """Whether ``version`` is still used after the update that replaces it."""
        last = self.last_use.get(version)
        replaced = self.replaced_at.get(version)
        return last is not None and replaced is not None and last > replaced


def version_use(
    table: Sequence[Action], *, initial_version: int, stage: int | None = None
) -> VersionUse:
    """The :class:`VersionUse` of one stage replica's ``table`` (``stage``: of that stage's
    actions in a rank's table that holds several stages; positions stay the table's)."""
    last_use: dict[int, int] = {}
    updates: list[int] = []
    for position, action in enumerate(table):
        if stage is not None and action.stage != stage:
            continue
        if action.version is not None:
            last_use[action.version] = position
        if action.op is Op.UPDATE:
            updates.append(position)
    # version v is created by the (v - initial)-th update and replaced by the next one
    replaced_at = {initial_version + i: position for i, position in enumerate(updates)}
    return VersionUse(last_use, replaced_at)
