"""The executor catalog: what server workers can run, published to the broker for routing.

A job may target a device, but some executors must never leave the server (spec section
7): a non-packable executor (it needs what only the server has) and an invocation bound
to a provider skill (its tokens live on the server). A device worker refuses such a job
when it leases it (``E_SERVER_PINNED``), but by then the producer has long gone. So the
refusal happens at submit: the producer (`client.Client.submit`, hence ``metnos-exec
submit``) often has no executors folder, only the broker, so **server workers publish
their executors' manifests to the broker** when they start (`Broker.publish_executors`),
again after a failed try, when the store is back after failing, and every five minutes
(a broker that lost them, such as Redis restarted without persistence, has them back),
and submit looks the executor up there (`Broker.executor_info`) and refuses a device job
that `device_refusal` says must stay on the server, before anything is queued.

What it does not cover, on purpose: an executor no server worker has published yet (a
fresh queue) is queued as before, and the device worker's lease-time refusal remains the
backstop; so does a producer in another language writing the queue directly. A broker
without a catalog (the base class's default) publishes nothing and knows nothing, with
the same backstop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
import msgspec.inspect

from ..capabilities import effective_capabilities, final_args
from ..errors import MetnosError
from ..manifest import Manifest

__all__ = ("ExecutorInfo", "decode_info", "device_refusal", "encode_info")


class ExecutorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One executor as a server worker published it.

    Attributes:
        v: format version.
        name: the executor's name.
        manifest: its manifest (capabilities and argument schema decide pinning per job).
        worker: the worker that published it.
        at: unix seconds it was published.
    """

    name: str
    manifest: Manifest
    worker: str = ""
    at: float = msgspec.field(default_factory=time.time)
    v: int = 1


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ExecutorInfo)


def encode_info(info: ExecutorInfo) -> bytes:
    return _encoder.encode(info)


def decode_info(data: bytes | str) -> ExecutorInfo | None:
    """The entry, or ``None`` for one this reader cannot decode.

    An entry a newer worker published may hold manifest fields this build does not know
    (a manifest on disk with such a field is refused at load, as it must be: its author
    meant it). Read from the catalog, the fields this reader knows are what it acts on
    either way, so the unknown ones are dropped rather than the whole entry: otherwise a
    rolling upgrade makes every such executor vanish from the older producers' submit-time
    checks and from the tools an older MCP server offers. A field it knows with a value it
    cannot read still makes the entry unreadable (``None``)."""
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError:
        pass
    except Exception:  # DecodeError, and whatever else bytes in a store can make it raise
        return None
    try:
        raw = msgspec.json.decode(data)
        return msgspec.convert(_known(raw, _INFO_TYPE), ExecutorInfo)
    except Exception:
        return None


_INFO_TYPE = msgspec.inspect.type_info(ExecutorInfo)


def _known(value: Any, kind: msgspec.inspect.Type) -> Any:
    """`value` (decoded JSON) without the object keys `kind` does not declare, at every
    depth."""
    inspect = msgspec.inspect
    if isinstance(kind, inspect.UnionType):
        for member in kind.types:
            if isinstance(value, dict) and isinstance(
                member, inspect.StructType | inspect.DictType
            ):
                return _known(value, member)
            if isinstance(value, list) and isinstance(
                member, inspect.ListType | inspect.VarTupleType
            ):
                return _known(value, member)
        return value
    if isinstance(kind, inspect.StructType) and isinstance(value, dict):
        fields = {field.encode_name: field.type for field in kind.fields}
        return {k: _known(v, fields[k]) for k, v in value.items() if k in fields}
    if isinstance(kind, inspect.DictType) and isinstance(value, dict):
        return {k: _known(v, kind.value_type) for k, v in value.items()}
    if isinstance(kind, inspect.ListType | inspect.VarTupleType) and isinstance(value, list):
        return [_known(v, kind.item_type) for v in value]
    return value


def device_refusal(manifest: Manifest, args: Mapping[str, Any]) -> str | None:
    """Why a job of `manifest` with `args` may not go to a device, or ``None``.

    The same rule `plan.plan_invocation` applies on the worker (``server_pinned``): not
    packable, or an active, valid provider binding for these arguments. Arguments the
    schema refuses give ``None`` here: the worker rejects them with the precise error.
    """
    if not manifest.packable:
        return "it is not packable (packable = false: it needs what only the server has)"
    try:
        effective = effective_capabilities(manifest, final_args(manifest, args))
    except MetnosError:
        return None
    if effective.server_pinned:
        skills = ", ".join(effective.provider_bindings)
        return f"it acts with provider authority ({skills}), whose tokens stay on the server"
    return None
