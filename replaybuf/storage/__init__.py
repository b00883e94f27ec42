"""TorchRL slot storage, field specs, staging, device mirrors: the only layer that knows TorchRL
storages."""

from replaybuf.storage.convert import Leaf, decode, to_leaves
from replaybuf.storage.delivery import Part, to_device_async
from replaybuf.storage.devices import NORMAL_TENSORS, resolve_device, resolve_kind
from replaybuf.storage.fastrow import RowPlan
from replaybuf.storage.mirror import DeviceMirror
from replaybuf.storage.ragged import Ragged, RaggedColumn
from replaybuf.storage.ringbatch import UniformBatch, uniform_batch
from replaybuf.storage.ringchunk import ChunkWriter, chunk_writer
from replaybuf.storage.ringrow import RowWriter, row_writer
from replaybuf.storage.schema import Field, FieldSpec, Key, field_key, key_name
from replaybuf.storage.slots import SlotStorage
from replaybuf.storage.space import free_bytes
from replaybuf.storage.staging import RowStager
from replaybuf.storage.tensordicts import build_tensordict, nest

__all__ = [
    "NORMAL_TENSORS",
    "ChunkWriter",
    "DeviceMirror",
    "Field",
    "FieldSpec",
    "Key",
    "Leaf",
    "Part",
    "Ragged",
    "RaggedColumn",
    "RowPlan",
    "RowStager",
    "RowWriter",
    "SlotStorage",
    "UniformBatch",
    "build_tensordict",
    "chunk_writer",
    "decode",
    "field_key",
    "free_bytes",
    "key_name",
    "nest",
    "resolve_device",
    "resolve_kind",
    "row_writer",
    "to_device_async",
    "to_leaves",
    "uniform_batch",
]
