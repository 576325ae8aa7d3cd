"""FlashNextFamily: builds a Flash-Next runner from an artifact, with its residency options.

Loading follows gpt-fast (`ninfer_core.nn.loading`): modules on the meta device, then the artifact's
memory-mapped tensors assigned by name (`model.` or `model.language_model.` prefix; per-expert
weights fused). Two kinds of tensors are not assigned: the n-gram tables (`...ple_embedding.
ngram_embedding[.shard_N].weight`, read per pass from the file: see rows.py) and, with host or disk
expert residency, the routed expert banks (experts.py).
"""

from __future__ import annotations

import os
import re

import torch

from ninfer_core.accel import resolve_dtype
from ninfer_core.engine.model_api import ModelFamily
from ninfer_core.nn.loading import LoadError, assign_weights, eos_token_ids, fuse_experts
from ninfer_core.nn.mtp import MtpHead
from ninfer_flash_next.chat import FLASH_NEXT_CHAT_FORMAT, FLASH_NEXT_TEMPLATE, SAMPLING_PRESETS
from ninfer_flash_next.config import FlashNextConfig
from ninfer_flash_next.experts import (
    MISSES,
    RESIDENCIES,
    ExpertCache,
    ExpertCounters,
    ExpertProfile,
    FileBank,
    HostBank,
    OffloadedExperts,
)
from ninfer_flash_next.model import FlashNextModel
from ninfer_flash_next.rows import NgramRows, RowCounters, TableFile
from ninfer_flash_next.runner import FlashNextRunner

TEXT_PREFIXES = ("model.language_model.", "model.")
_TABLE = re.compile(r"^layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding(?:\.shard_(\d+))?\.weight$")
_HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$")

DEFAULTS = {"expert_residency": "device", "expert_cache_mib": "auto", "expert_misses": "staged",
            "expert_profile": None, "expert_profile_out": None, "ngram_table": None, "ngram_residency": "disk",
            "ngram_io": "buffered", "ngram_io_depth": 64, "ngram_ram_mib": None, "ngram_hot_profile": None,
            "no_ngram_table": False}  # fmt: skip


def _opt(options, name):
    v = getattr(options, name, None) if options is not None else None
    return DEFAULTS[name] if v is None else v


class FlashNextFamily(ModelFamily):
    name = "flash_next"
    chat_template = FLASH_NEXT_TEMPLATE  # the Qwen3.5 markup (turns, <think>, XML tool calls): chat.py

    def chat_format(self, artifact):
        return FLASH_NEXT_CHAT_FORMAT

    def sampling_presets(self, architecture: str) -> dict | None:
        return {k: dict(v) for k, v in SAMPLING_PRESETS.items()}

    def load(self, artifact, device: str = "cpu", dtype: str | None = None, options=None) -> FlashNextRunner:
        dev = torch.device(device)
        run_dtype = resolve_dtype(dtype, dev)
        cfg = FlashNextConfig.from_hf(artifact.config, getattr(artifact, "architecture", None))
        residency = _opt(options, "expert_residency")
        if residency not in RESIDENCIES:
            raise ValueError(f"--expert-residency must be one of {', '.join(RESIDENCIES)}, not {residency!r}")
        misses = _opt(options, "expert_misses")
        if misses not in MISSES:
            raise ValueError(f"--expert-misses must be one of {', '.join(MISSES)}, not {misses!r}")

        names = list(artifact.tensor_names())
        prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p + "layers.") for n in names)), None)
        if prefix is None:
            raise LoadError("no text-model layers found (expected model.layers.* or model.language_model.layers.*)")
        state, tables, hashes, experts = {}, {}, {}, {}
        for n in names:
            if n == "lm_head.weight":
                state[n] = artifact.get_tensor(n)
                continue
            if not n.startswith(prefix):
                continue
            short = n[len(prefix):]
            m = _TABLE.match(short)
            if m:
                tables.setdefault(int(m[1]), []).append((int(m[2] or 0), n))
                continue
            if short.rsplit(".", 1)[-1] in _HASH_BUFFERS:
                hashes[short] = artifact.get_tensor(n)
                continue
            m = _EXPERT.match(short)
            if m and residency != "device":
                experts.setdefault(int(m[1]), []).append((short, n))
                continue
            state[short] = artifact.get_tensor(n)
        with torch.device("meta"):
            model = FlashNextModel(cfg)
        tied = cfg.base.tie_word_embeddings or "lm_head.weight" not in state
        if tied:
            state.pop("lm_head.weight", None)
        skip = {"lm_head.weight"} if tied else set()
        if residency != "device":
            skip |= {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
        assign_weights(model, fuse_experts(state), run_dtype, dev, skip=skip)
        if tied:
            model.lm_head.weight = model.embed_tokens.weight
        model.init_rotary(dev)

        extras = {}
        self._ngram(artifact, cfg, model, tables, hashes, prefix, options, extras)
        if residency != "device":
            self._experts(artifact, cfg, model, experts, residency, misses, run_dtype, dev, options, extras)
        elif _opt(options, "expert_profile") or _opt(options, "expert_profile_out"):
            raise ValueError("--expert-profile and --expert-profile-out need --expert-residency host or disk")

        mtp = None
        mtp_names = [n for n in names if n.startswith("mtp.")]
        if mtp_names:
            with torch.device("meta"):
                mtp = MtpHead(cfg.base)
            assign_weights(mtp, fuse_experts({n.removeprefix("mtp."): artifact.get_tensor(n) for n in mtp_names}),
                    run_dtype, dev)
        if dev.type == "cuda":  # core's GDN kernels (Triton conv + delta step, fla prefill)
            from ninfer_flash_next.gpu.gdn import use_kernels

            use_kernels(model)
        tok = getattr(artifact, "tokenizer_section", None)
        eos = eos_token_ids(tok) if isinstance(tok, dict) else ()
        return FlashNextRunner(model, cfg, dev, run_dtype, mtp=mtp, eos_token_ids=eos, extras=extras)

    # ---- the n-gram tables --------------------------------------------------------------------
    def _ngram(self, artifact, cfg, model, tables, hashes, prefix, options, extras) -> None:
        if not cfg.ple_layer_ids:
            return
        if _opt(options, "no_ngram_table"):
            return  # PLE modules stay without rows: skipped (a non-standard experimental mode)
        source = artifact
        path = _opt(options, "ngram_table")
        if path:
            from ninfer_core.artifact import Artifact

            source = Artifact.open(path)
            tables = {}
            for n in source.tensor_names():
                m = _TABLE.match(n.removeprefix("model.language_model.").removeprefix("model."))
                if m:
                    tables.setdefault(int(m[1]), []).append((int(m[2] or 0), n))
            extras["ngram_artifact"] = source
        hot = None
        hot_path = _opt(options, "ngram_hot_profile")
        if hot_path:
            hot = _read_hot_profile(hot_path)
        counters = RowCounters()
        extras["ngram_counters"] = counters
        for layer in cfg.ple_layer_ids:
            ple = model.layers[layer].ple
            where = f"{prefix}layers.{layer}.ple.ple_embedding"
            ple.hasher.check_buffers(*(hashes.get(f"layers.{layer}.ple.ple_embedding.{b}") for b in _HASH_BUFFERS),
                                     where)
            parts = sorted(tables.get(layer, []))
            if parts and not hasattr(source, "tensor_file_range"):  # an in-memory source (bench weights)
                ple.rows = NgramRows.resident(torch.cat([source.get_tensor(n) for _, n in parts]), counters)
                continue
            if not parts:
                raise LoadError(f"{where}.ngram_embedding: the n-gram table is not in "
                                f"{'the table artifact' if path else 'the artifact'} (give --ngram-table PATH, "
                                "or --no-ngram-table to run without it)")
            shards, first, dim, dtype = [], 0, None, None
            for _, name in parts:
                shape = source.tensor_shape(name)
                off, _length = source.tensor_file_range(name)
                shards.append((first, shape[0], off))
                first += shape[0]
                dim, dtype = shape[1], source.tensor_dtype(name)
            if first != ple.hasher.rows or dim != cfg.ngram_row_dim:
                raise LoadError(f"{where}.ngram_embedding: {first} x {dim} rows stored, the config "
                                f"hashes into {ple.hasher.rows} x {cfg.ngram_row_dim}")
            table = TableFile(source.path, tuple(shards), dim, dtype)
            ple.rows = NgramRows(table, _opt(options, "ngram_residency"), _opt(options, "ngram_io"),
                                 int(_opt(options, "ngram_io_depth")), _opt(options, "ngram_ram_mib"), hot, counters)

    # ---- host / disk experts ------------------------------------------------------------------
    def _experts(self, artifact, cfg, model, experts, residency, misses, dtype, dev, options, extras) -> None:
        base = cfg.base
        e_count, inter, hidden = base.num_experts, base.moe_intermediate_size, base.hidden_size
        expert_bytes = 3 * inter * hidden * torch.empty((), dtype=dtype).element_size()
        mib = _opt(options, "expert_cache_mib")
        total = base.num_hidden_layers * e_count * expert_bytes
        if mib == "auto":
            if dev.type == "cuda":
                free, _ = torch.cuda.mem_get_info(dev)
                budget = max(0, free - (2 << 30))
            else:  # the CPU is the device: a quarter of the banks (host mode computes the rest in place)
                budget = total // 4
        else:
            try:
                budget = int(mib) << 20
            except (TypeError, ValueError):
                raise ValueError(f"--expert-cache-mib must be a number of MiB or auto, not {mib!r}") from None
            if budget < 0:
                raise ValueError("--expert-cache-mib must be >= 0")
        slots = min(budget // expert_bytes, base.num_hidden_layers * e_count)
        if residency == "disk" and slots == 0:
            raise ValueError(f"--expert-residency disk needs a device expert cache: --expert-cache-mib must hold "
                             f"at least one expert ({-(-expert_bytes // (1 << 20))} MiB)")
        counters = ExpertCounters()
        cache = ExpertCache(slots, 2 * inter, hidden, inter, dtype, dev, counters) if slots else None
        counters.slots = slots
        manifest = getattr(artifact, "manifest", None) or {}
        identity = (manifest.get("identity") or {}).get("model_id") or getattr(artifact, "name", "model")
        geometry = {"layers": base.num_hidden_layers, "experts": e_count, "hidden": hidden, "inter": inter,
                    "dtype": str(dtype).removeprefix("torch.")}
        profile = None
        out_path, in_path = _opt(options, "expert_profile_out"), _opt(options, "expert_profile")
        if out_path or in_path:
            profile = ExpertProfile(identity, geometry, base.num_hidden_layers, e_count)
            profile.out_path = os.fspath(out_path) if out_path else None
            if profile.out_path:  # the counts of the last requests too (writes are throttled to one per 2 s)
                import atexit

                atexit.register(profile.maybe_write, True)
        banks = {}
        for layer in range(base.num_hidden_layers):
            entries = dict(experts.get(layer, []))
            pre = f"layers.{layer}.mlp.experts"
            if residency == "host":
                fused = fuse_experts({short: artifact.get_tensor(n) for short, n in entries.items()})
                try:
                    gu, dn = fused[pre + ".gate_up_proj"], fused[pre + ".down_proj"]
                except KeyError:
                    raise LoadError(f"{pre}: routed expert weights missing") from None
                bank = HostBank(gu.to(dtype).contiguous(), dn.to(dtype).contiguous(), pin=dev.type == "cuda")
            else:
                bank = FileBank(artifact, *_file_parts(pre, entries, e_count), dtype)
            banks[layer] = bank
            model.layers[layer].mlp.experts = OffloadedExperts(layer, bank, cache, misses, e_count, counters, profile)
        if in_path and cache is not None:
            for layer, e in profile.ranked(os.fspath(in_path))[:slots]:
                gu, dn = banks[layer].expert(e)
                cache.admit((layer, e), gu, dn, evict=False)
        extras.update(expert_counters=counters, expert_cache=cache, expert_profile=profile)


def _file_parts(pre: str, entries: dict, e_count: int):
    """Per expert the (tensor name, fused row or None) parts of its gate_up and down matrices."""
    gu, dn = [], []
    for e in range(e_count):
        if pre + ".gate_up_proj" in entries:
            gu.append([(entries[pre + ".gate_up_proj"], e)])
            dn.append([(entries[pre + ".down_proj"], e)])
            continue
        try:
            gu.append([(entries[f"{pre}.{e}.gate_proj.weight"], None), (entries[f"{pre}.{e}.up_proj.weight"], None)])
            dn.append([(entries[f"{pre}.{e}.down_proj.weight"], None)])
        except KeyError as exc:
            raise LoadError(f"{pre}: expert {e}'s weights are missing ({exc})") from None
    return gu, dn


def _read_hot_profile(path) -> list[int]:
    """A ninfer-ngram-profile file: row ids, hottest first, one per line (or a JSON list)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--ngram-hot-profile {path}: {e.strerror}") from None
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
    except ValueError:
        raise ValueError(f"--ngram-hot-profile {path}: expected row ids (a JSON list or one per line)") from None
    return [int(r) for r in rows]


def _random_artifact(self, hf_config: dict, device: str = "cuda", seed: int = 0, **kw):
    """An artifact-like source of random weights at `hf_config`'s shape, drawn on `device` as the
    loader asks (`ninfer bench`, the GPU checks; nothing is written)."""
    from ninfer_flash_next.gpu.random_model import RandomArtifact
    from ninfer_flash_next.testing import minimal_tokenizer_section

    kw.setdefault("tokenizer_section", minimal_tokenizer_section())
    kw.setdefault("chat_template", FLASH_NEXT_TEMPLATE)
    dev = torch.device(device)
    return RandomArtifact(hf_config, device=dev, dtype=kw.pop("dtype", resolve_dtype(None, dev)), seed=seed, **kw)


def _transformers_model(self, runner, hf_config: dict):
    """transformers' model of the same weights, sharing `runner`'s tensors (no copy)."""
    from ninfer_flash_next.gpu.random_model import transformers_model

    return transformers_model(runner, hf_config)


FlashNextFamily.random_artifact = _random_artifact
FlashNextFamily.transformers_model = _transformers_model
