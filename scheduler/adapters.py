"""The LoRA adapters as the scheduler knows them (engine/contracts/lora.py): which names are
served and under which id, the loads in flight, and the checks of a runtime load or unload.

The worker holds the weights; the scheduler owns the names and ids. A load gets a new id
(never reused) and is served once the worker's answer comes back; an unload takes the name
away at once, and only when no request runs under it, so no step sent later names it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import msgspec

from engine.contracts.lora import LoraAdapterInfo, lora_namespace
from engine.contracts.protocol import LoraUpdate, LoraUpdated
from engine.contracts.worker_messages import ModelInfo
from scheduler.request import Request


class Adapters:
    def __init__(self, info: ModelInfo) -> None:
        self.enabled = info.max_loras > 0
        self.served = {adapter.name: adapter for adapter in info.lora_adapters}
        self.loading: dict[str, str] = {}  # update rid -> the name it loads
        # every adapter loaded since start, by its own namespace: KV events name the adapter
        # of blocks cached under it, also after it was unloaded
        self.by_namespace = {lora_namespace(None, a): a for a in info.lora_adapters}
        self.next_id = 1 + max((a.lora_id for a in info.lora_adapters), default=0)

    def check_update(self, msg: LoraUpdate, requests: Iterable[Request]
                     ) -> LoraUpdate | LoraUpdated:
        """The update for the worker (a load with its id), or the refusal for the frontend: a
        name served or loading already, an unknown name, an adapter ``requests`` run under."""
        def refused(status: int, error: str) -> LoraUpdated:
            return LoraUpdated(rid=msg.rid, reply_to=msg.reply_to, error=error, status=status,
                               adapters=list(self.served.values()))

        if not self.enabled:
            return refused(400, "LoRA adapters need a server started with --enable-lora")
        if msg.path is not None:
            if msg.name in self.served or msg.name in self.loading.values():
                return refused(400, f"the LoRA adapter {msg.name!r} is already loaded; unload "
                                    "it first to load other weights under that name")
            self.loading[msg.rid] = msg.name
            self.next_id += 1
            return msgspec.structs.replace(msg, lora_id=self.next_id - 1)
        adapter = self.served.get(msg.name)
        if adapter is None:
            return refused(404, f"the LoRA adapter {msg.name!r} is not loaded")
        users = sum(r.lora_id == adapter.lora_id for r in requests)
        if users:
            return refused(400, f"the LoRA adapter {msg.name!r} has {users} requests in "
                                "flight; unload it once they have finished")
        del self.served[msg.name]
        return msgspec.structs.replace(msg, lora_id=adapter.lora_id)

    def updated(self, msg: LoraUpdated) -> LoraUpdated:
        """The worker's answer to an update: a loaded adapter is served from now on; the
        answer carries every adapter served."""
        self.loading.pop(msg.rid, None)
        if msg.adapter is not None:
            self.served[msg.adapter.name] = msg.adapter
            self.by_namespace[lora_namespace(None, msg.adapter)] = msg.adapter
        msg.adapters = list(self.served.values())
        return msg

    def of_namespace(self, namespace: Hashable) -> LoraAdapterInfo | None:
        """The adapter whose prefixes ``namespace`` holds (its own part comes last,
        ``lora_namespace``), None for the base model's."""
        return self.by_namespace.get(str(namespace).rpartition("|")[2])
