"""`--vision` at load time: the artifact's tower through the selected residency, and the media
service the protocols prepare requests with."""

from __future__ import annotations

import logging
from typing import Any

from ninfer_core.media.prompt import MediaService

log = logging.getLogger("ninfer.media")


class VisionLoadError(RuntimeError):
    pass


def load_vision(ctx: Any, family: Any, artifact: Any, runner: Any, vocab_size: int,
                tokenizer: Any = None) -> tuple[Any, MediaService]:
    """(the loaded VisionResidency, the MediaService) for a server started with --vision."""
    opts = ctx.options.media
    reg = ctx.plugins.resolve("vision_residency", opts.residency)  # an unknown name lists the others
    if "vision" not in (getattr(artifact, "components", None) or []):
        raise VisionLoadError("--vision needs an artifact with a vision tower (component 'vision'); this one has "
                              f"{', '.join(artifact.components or []) or 'none'}: convert the checkpoint with its "
                              "model.visual.* tensors")
    processor = family.media_processor(artifact)
    if processor is None:
        raise VisionLoadError(f"the {artifact.architecture} family reads no media")
    if tokenizer is not None and hasattr(processor, "encode_text"):  # text the expansion writes (video times)
        processor.encode_text = lambda text: tokenizer.encode(text, allow_special=False)
    target = reg.load()
    residency = target.load(family, artifact, runner, ctx.options.plugin_options)
    service = MediaService(processor, opts, vocab_size, ctx.options.max_request_mib << 20,
                           permit_timeout_s=ctx.options.engine.pending_timeout_ms / 1000.0)
    if service.max_merged < processor.min_merged:
        raise VisionLoadError(f"--vision-max-merged {service.max_merged} is below the {processor.min_merged} merged "
                              f"tokens the {artifact.architecture} family prepares an item at")
    residency.max_item_tokens = service.max_merged  # a runner with whole_media_spans runs one item per forward
    log.info("vision: residency %s (%s), at most %d merged tokens per item, media cache %d MiB (live %d MiB)",
             opts.residency, ", ".join(f"{k} {v}" for k, v in residency.describe().items() if k != "residency"),
             service.max_merged, opts.cache_mib, opts.live_mib)
    return residency, service
