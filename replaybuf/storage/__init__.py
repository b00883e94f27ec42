"""TorchRL slot storage, field specs, staging, device mirrors: the only layer that knows TorchRL
storages."""

from replaybuf.storage.fastrow import RowPlan
from replaybuf.storage.mirror import DeviceMirror
from replaybuf.storage.schema import Field, FieldSpec, Key, key_name, to_leaves
from replaybuf.storage.slots import (
    NORMAL_TENSORS,
    Part,
    SlotStorage,
    build_tensordict,
    free_bytes,
    nest,
    resolve_device,
    resolve_kind,
    to_device_async,
)
from replaybuf.storage.staging import RowStager

__all__ = [
    "NORMAL_TENSORS",
    "DeviceMirror",
    "Field",
    "FieldSpec",
    "Key",
    "Part",
    "RowPlan",
    "RowStager",
    "SlotStorage",
    "build_tensordict",
    "free_bytes",
    "key_name",
    "nest",
    "resolve_device",
    "resolve_kind",
    "to_device_async",
    "to_leaves",
]
