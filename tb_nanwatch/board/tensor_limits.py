"""The declared size of a stored tensor, checked before TensorBoard expands it.

TensorBoard's ``make_ndarray`` fills a tensor's declared shape from one stored
value: a 3 KB event file can declare a gigabyte. Both data providers turn
every stored value into an array when asked for a tag, so the reader asks
these functions first: for the Python loader (``MultiplexerDataProvider``)
the stored protos are looked at through its multiplexer; for the Rust data
server (``GrpcDataProvider``) the gRPC answer is converted here, each value
after its declared size is checked. A tag whose kept values declare more than
:data:`~tb_nanwatch.evidence.limits.MAX_TENSOR_BYTES` in all is left out.
"""

from __future__ import annotations

from collections.abc import Callable

from tensorboard.compat.tensorflow_stub import dtypes
from tensorboard.data import provider
from tensorboard.util import tensor_util

from tb_nanwatch.evidence import limits, metadata


def proto_bytes(proto) -> int:
    """Bytes a ``TensorProto`` declares (its shape x its dtype's size)."""
    try:
        itemsize = dtypes.as_dtype(proto.dtype).size
    except (TypeError, ValueError, KeyError):
        itemsize = 1
    return limits.declared_bytes((d.size for d in proto.tensor_shape.dim), itemsize)


def refused_tags(data_provider, runs: list[str], tags: list[str]) -> dict[tuple[str, str], int]:
    """``{(run, tag): declared bytes}`` of the tags over the limit, for a
    provider over a multiplexer (others: nothing is known here, {})."""
    multiplexer = getattr(data_provider, "_multiplexer", None)
    if multiplexer is None or not hasattr(multiplexer, "Tensors"):
        return {}
    refused = {}
    for run in runs:
        for tag in tags:
            try:
                events = multiplexer.Tensors(run, tag)
            except KeyError:
                continue
            size = sum(proto_bytes(event.tensor_proto) for event in events)
            if size > limits.MAX_TENSOR_BYTES:
                refused[(run, tag)] = size
    return refused


def read_grpc(
    data_provider,
    experiment_id: str,
    runs: list[str],
    tags: list[str],
    downsample: int,
    on_refused: Callable[[str, str, int], None],
) -> dict[str, dict[str, list[provider.TensorDatum]]]:
    """``GrpcDataProvider.read_tensors`` of ``runs`` x ``tags`` (all kept
    values), each tag's declared size checked before any value is expanded."""
    from tensorboard.data import grpc_provider
    from tensorboard.data.proto import data_provider_pb2

    request = data_provider_pb2.ReadTensorsRequest(experiment_id=experiment_id)
    request.plugin_filter.plugin_name = metadata.PLUGIN_NAME
    request.run_tag_filter.runs.names.extend(sorted(runs))
    request.run_tag_filter.tags.names.extend(sorted(tags))
    request.downsample.num_points = downsample
    with grpc_provider._translate_grpc_error():
        response = data_provider._stub.ReadTensors(request)
    result: dict[str, dict[str, list[provider.TensorDatum]]] = {}
    for run_entry in response.runs:
        result[run_entry.run_name] = by_tag = {}
        for tag_entry in run_entry.tags:
            data = tag_entry.data
            size = sum(proto_bytes(value) for value in data.value)
            if size > limits.MAX_TENSOR_BYTES:
                on_refused(run_entry.run_name, tag_entry.tag_name, size)
                continue
            by_tag[tag_entry.tag_name] = [
                provider.TensorDatum(
                    step=step, wall_time=wall, numpy=tensor_util.make_ndarray(value)
                )
                for step, wall, value in zip(data.step, data.wall_time, data.value, strict=False)
            ]
    return result
