"""Adapters loaded and unloaded while the engine serves (`--enable-runtime-lora`, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter).

The engine keeps `--max-loras` adapter slots (start-up adapters first) of rank `--max-lora-rank`, allocated on
every adaptable layer at start-up, so loading one is copying its weights into a free slot on every rank. Every
call here runs in the engine's step thread, between steps (AsyncEngine.call), so no forward sees a half-loaded
slot. A load is checked like a start-up adapter (files, config, target modules, the base model's shapes) plus its
name and rank and a free slot; each refusal is a LoraError with one line. An unload first takes the name away (new
requests for it are refused), keeps the slot while requests already on it run, and empties it once none does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.lora.adapter import LoraError, check_against, read_adapter
from engine.lora.names import check_names, parse_lora_adapters


@dataclass(slots=True)
class RuntimeAdapters:
    engine: Any                 # LLMEngine: adapter_names (one per slot, None when free), runner, model_config
    base_name: str
    max_rank: int
    draining: dict[str, int] = field(default_factory=dict)     # name -> its slot, until its requests end

    def names(self) -> list[str]:
        return [name for name in self.engine.adapter_names if name]

    def load(self, name: str, path: str) -> None:
        if "," in name or "," in path:
            raise LoraError(f"LoRA adapter {name!r} ({path}): a name or a path cannot hold a comma")
        parse_lora_adapters(f"{name}={path}")       # the name's rules (a ValueError naming it)
        check_names([(name, path)], self.base_name)
        if name in self.engine.adapter_names or name in self.draining:
            raise LoraError(f"LoRA adapter {name!r} is already loaded; unload it first or pick another name")
        adapter = read_adapter(name, path)
        check_against(adapter, self.engine.model_config, self.base_name)
        if adapter.max_rank > self.max_rank:
            raise LoraError(f"LoRA adapter {name!r} ({path}) has rank {adapter.max_rank}, more than this server's "
                            f"--max-lora-rank {self.max_rank}")
        taken = set(self.draining.values())
        free = [i for i, n in enumerate(self.engine.adapter_names) if n is None and i not in taken]
        if not free:
            raise LoraError(f"no free LoRA slot: {len(self.engine.adapter_names)} of --max-loras "
                            f"{len(self.engine.adapter_names)} are taken ({', '.join(self.names())}); unload one first")
        self.engine.runner.load_lora(free[0], name, str(path))
        # a new prefix-cache chain start: blocks cached under the slot's earlier adapter are never shared
        self.engine.adapter_keys[free[0]] = max(self.engine.adapter_keys) + 1
        self.engine.adapter_names[free[0]] = name

    def begin_unload(self, name: str) -> None:
        """Refuse new requests for `name`; its slot stays until `try_finish_unload` finds it unused."""
        if name not in self.engine.adapter_names:
            loaded = ", ".join(repr(n) for n in self.names()) or "none"
            raise LoraError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        slot = self.engine.adapter_names.index(name)
        self.engine.adapter_names[slot] = None
        self.draining[name] = slot

    def try_finish_unload(self, name: str) -> bool:
        """True once no request runs on `name` and its slot is emptied."""
        slot = self.draining.get(name)
        if slot is None:
            return True
        if self.engine.adapter_in_use(slot + 1):
            return False
        self.engine.runner.unload_lora(slot)
        del self.draining[name]
        return True

