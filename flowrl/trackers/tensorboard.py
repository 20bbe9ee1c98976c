"""`tensorboard`: event files under RUN_DIR/tensorboard (the default tracker).

The scalars of `flowrl.trackers.scalars`, the staleness of each step as a histogram
(`runtime/staleness`), and the sample rows as one markdown table per step (text `samples`).
A checkpoint records each event file's size and a resume cuts them back to it
(flowrl/runtime/durability/streams.py), so this tracker never holds a step twice.
"""

from __future__ import annotations

from typing import Any, ClassVar

from flowrl.trackers import SAMPLE_COLUMNS, TrackerContext, sample_cells, scalars


class TensorBoard:
    requires: ClassVar[tuple[str, ...]] = ("tensorboard",)
    rewound: ClassVar[bool] = True  # its event files are record streams: a resume cuts them back

    def __init__(self) -> None:
        self.writer: Any = None
        self.origin = 0.0

    def open(self, context: TrackerContext) -> dict[str, Any]:
        # TensorBoard's own event writer: torch.utils.tensorboard would import torch (seconds)
        # into the coordinator, which otherwise never needs it.
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(context.run_dir / "tensorboard"))
        self.origin = context.origin
        return {}

    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        by_step: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for sample in samples:
            by_step.setdefault((sample["node"], sample["step"]), []).append(sample)
        for row in rows:
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars(row).items()]
            if row.get("staleness"):
                values.append(Summary.Value(tag="runtime/staleness", histo=_histogram(row["staleness"])))
            if (row["node"], row["step"]) in by_step:
                values.append(_text("samples", _markdown(by_step.pop((row["node"], row["step"])))))
            self.writer.add_event(Event(wall_time=self.origin + row["time"], step=row["step"],
                                        summary=Summary(value=values)))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _histogram(staleness: dict[str, int]) -> Any:
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    lags = {int(k): n for k, n in staleness.items()}
    top = max(lags)
    return HistogramProto(
        min=min(lags), max=top, num=sum(lags.values()), sum=sum(k * n for k, n in lags.items()),
        sum_squares=sum(k * k * n for k, n in lags.items()),
        bucket_limit=[k + 0.5 for k in range(top + 1)], bucket=[lags.get(k, 0) for k in range(top + 1)])


def _text(tag: str, markdown: str) -> Any:
    """A TensorBoard text summary (the text plugin reads a string tensor)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    tensor = TensorProto(dtype=7, string_val=[markdown.encode()],  # 7: DT_STRING
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    return Summary.Value(tag=tag, metadata=meta, tensor=tensor)


def _markdown(samples: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in sample_cells(s)) + " |" for s in samples]
    return "\n".join(lines)
