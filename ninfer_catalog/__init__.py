"""The project's catalog of first-party plugin distributions, for "install X" hints.

A missing model family, speculative backend or serve option is reported with the distribution to
install; that needs a table of names no installed plugin can supply (the plugin is what is
missing). The table is data of the ninfer-core distribution kept outside the `ninfer_core`
package, which names no model family (tests/test_core_names_no_family.py); core reads it only to
word those messages and to tell `ninfer convert` an architecture has a package at all.
"""

from __future__ import annotations

# architecture (HF model_type) -> distribution of the family that serves it
FAMILY_PACKAGES = {
    "qwen3_5": "ninfer-qwen35",
    "qwen3_5_moe": "ninfer-qwen35",
    "qwen3_5_text": "ninfer-qwen35",
    "qwen3_5_moe_text": "ninfer-qwen35",
    "gemma4": "ninfer-gemma4",
    "gemma4_text": "ninfer-gemma4",
    "qwen4_exp": "ninfer-flash-next",
    "qwen4_exp_text": "ninfer-flash-next",
}
