"""Resolve one model's serve arguments into what the Loader needs, failing before any weight is read.

The steps of a single-model server's startup (spec "Startup readiness"): the options, the
speculative backend and its options, the artifact, its model family, the KV dtype and the chat
template. A router runs them for every catalog model at startup (so a bad preset fails there)
and again when a model loads.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from ninfer_core.config import ServeOptions, options_from_args

log = logging.getLogger("ninfer")


class PrepareError(Exception):
    pass


@dataclass
class Prepared:
    options: ServeOptions
    artifact: Any
    family_reg: Any
    template: Any
    spec_reg: Any


def model_options(args: argparse.Namespace, host: Any) -> ServeOptions:
    from ninfer_core.plugins import PluginError
    from ninfer_core.server.loader import resolve_kv_dtype

    try:
        options = options_from_args(args)
    except ValueError as e:
        raise PrepareError(str(e)) from None
    options.plugin_options = argparse.Namespace(
        **{o.dest: getattr(args, o.dest, o.kwargs.get("default")) for o in host.serve_options()})
    try:
        spec_reg = host.resolve_spec_backend(options.spec) if options.spec else None
        if spec_reg is not None:
            spec_reg.load().check_options(options.plugin_options)
    except (PluginError, ValueError) as e:
        raise PrepareError(str(e)) from None
    options._spec_reg = spec_reg
    return options


def prepare(options: ServeOptions, host: Any) -> Prepared:
    from ninfer_core.artifact import Artifact, ArtifactError
    from ninfer_core.plugins import PluginError
    from ninfer_core.tokenizer.builtin_templates import family_chat_template, resolve_chat_template
    from ninfer_core.tokenizer.chat_template import ChatTemplate, TemplateError

    path = options.artifact
    try:
        artifact = Artifact.open(path)
    except ArtifactError as e:
        raise PrepareError(str(e)) from None
    except OSError as e:
        raise PrepareError(f"cannot open artifact {path}: {e}") from None
    try:
        family_reg = host.family_for_architecture(artifact.architecture)
        from ninfer_core.server.loader import resolve_kv_dtype

        options.kv_format = resolve_kv_dtype(host, options.engine.kv_dtype)
        if options.chat_template:
            template = resolve_chat_template(options.chat_template)
        else:
            template = ChatTemplate(artifact.chat_template) if artifact.chat_template else None
        if template is None:
            target = family_reg.load()
            found = family_chat_template(target() if isinstance(target, type) else target, artifact.architecture)
            template = ChatTemplate(found[0]) if found is not None else None
    except (PluginError, TemplateError, ValueError) as e:
        artifact.close()
        raise PrepareError(str(e)) from None
    return Prepared(options, artifact, family_reg, template, getattr(options, "_spec_reg", None))
