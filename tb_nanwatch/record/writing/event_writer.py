"""Writes NaN Watch summaries to TensorBoard event files, without TensorFlow.

Uses TensorBoard's own ``EventFileWriter``, which goes through ``tf.io.gfile``
when TensorFlow is installed (so ``gs://``, ``ram://`` ... work) and through
plain files otherwise. Each writer owns its own event file (the file name holds
host, pid and a timestamp), so several processes can share one run dir.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util

from tb_nanwatch.evidence import metadata

# The suffix of every event file NanWatch writes (how a run dir is known to hold a record).
EVENT_FILE_SUFFIX = ".nanwatch"


def summary_metadata(kind: str) -> summary_pb2.SummaryMetadata:
    """The metadata of a NaN Watch summary of the given kind (a TENSOR-class summary)."""
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=metadata.plugin_content(kind)
        ),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


def json_dumps(value: object) -> str:
    """JSON with NaN/Infinity tokens kept (a NaN is the data, never dropped)."""
    return json.dumps(value, allow_nan=True, separators=(",", ":"))


def _string_tensor(text: str) -> tensor_pb2.TensorProto:
    return tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        string_val=[text.encode("utf-8")],
    )


class RunWriter:
    """Appends NaN Watch summaries to one event file in ``log_dir``."""

    def __init__(self, log_dir: str, filename_suffix: str = EVENT_FILE_SUFFIX) -> None:
        self.log_dir = log_dir
        self.filename_suffix = filename_suffix
        # flush_secs is large: flushing is driven explicitly by the journal.
        self._writer = EventFileWriter(
            log_dir, max_queue_size=64, flush_secs=3600, filename_suffix=filename_suffix
        )
        self._closed = False
        self.path = getattr(self._writer, "_file_name", None)
        self._identity = self._file_identity()

    def _file_identity(self) -> tuple[int, int] | None:
        """The event file's (device, inode), for a local file; else None."""
        if not isinstance(self.path, str) or "://" in self.path:
            return None
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_dev, info.st_ino

    def still_there(self) -> bool:
        """Whether the event file is still the one this writer writes: False
        when the log dir (or the file) was deleted or replaced meanwhile, and
        the writes go to a file nobody can read. Remote files: always True."""
        return self._identity is None or self._file_identity() == self._identity

    def reopened(self) -> RunWriter:
        """A new writer (a new event file) in the same log dir, made again if
        it was deleted; this one is closed (its file is gone anyway)."""
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the old file's writer may fail now
            self._closed = True
        return RunWriter(self.log_dir, self.filename_suffix)

    def _add(self, tag: str, kind: str, step: int, tensor: tensor_pb2.TensorProto) -> None:
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(
                    tag=tag,
                    metadata=summary_metadata(kind),
                    tensor=tensor,
                )
            ]
        )
        event = event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)
        try:
            self._writer.add_event(event)
        except Exception:
            if self.still_there():
                raise
            # The file is gone with its log dir: the journal's next flush
            # notices (still_there) and writes the record again.

    def write_json(self, tag: str, kind: str, step: int, value: object) -> None:
        self._add(tag, kind, step, _string_tensor(json_dumps(value)))

    def write_array(self, tag: str, kind: str, step: int, array: np.ndarray) -> None:
        self._add(tag, kind, step, tensor_util.make_tensor_proto(np.asarray(array, np.float32)))

    def flush(self) -> None:
        if not self._closed:
            try:
                self._writer.flush()
            except Exception:
                if self.still_there():
                    raise

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True
