"""A train batch's token ids against the model's vocabulary: a workflow or an operator upstream that
emits ids the embedding has no row for is named here, with the trajectory and position, instead of
failing with a bare IndexError inside the model."""

from __future__ import annotations

from flowrl.data.trajectory import Trajectory


def vocab_size(model_path: str) -> int:
    """The model's vocabulary (its text model's, for a vision-language one), from config.json."""
    from flowrl_operators.models import load_config

    return int(getattr(load_config(model_path).get_text_config(), "vocab_size", 0) or 0)


def out_of_vocabulary(trajectories: list[Trajectory], vocab: int) -> str | None:
    """The first token id outside 0..vocab-1, said with its trajectory and position (a workflow's or
    an operator's mistake upstream, which the embedding would answer with a bare IndexError)."""
    for t in trajectories:
        for field in ("prompt_ids", "response_ids"):
            ids = getattr(t, field)
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                i, bad = next((i, x) for i, x in enumerate(ids) if not 0 <= x < vocab)
                return (f"trajectory {t.id} (sample {t.sample_id}) has token id {bad} at {field}[{i}], outside "
                        f"the model's vocabulary (ids 0..{vocab - 1}); the node that built it (a workflow or an "
                        "operator upstream) must emit the model's own token ids")
    return None
