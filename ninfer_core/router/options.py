"""The router's and model suspend's serve options (spec "Several models (router)", "Model suspend")."""

from __future__ import annotations

import argparse

from ninfer_core.cli_support import integer


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several models (router) and model suspend")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every .ninfer in DIR under its file stem, and every subdirectory holding exactly one "
                        ".ninfer under the subdirectory's name, as a router (no artifact argument)")
    g.add_argument("--models-preset", default=None, metavar="FILE",
                   help="llama.cpp's INI model presets: [*] for every model, one section per model (model = PATH, "
                        "alias = a, b, load-on-startup = true, any serve option without its dashes)")
    g.add_argument("--models-max", type=integer(0), default=1, metavar="N",
                   help="most models loaded at once in a router; 0 for no limit")
    g.add_argument("--models-autoload", dest="models_autoload", action="store_true", default=argparse.SUPPRESS,
                   help="a request for a model that is not loaded loads it, or wakes it (the default; ?autoload=0|1 "
                        "overrides it per request)")
    g.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                   help="a request for a model that is not loaded fails with 503 model_not_loaded (default: off)")
    g.add_argument("--model-suspend", action="store_true",
                   help="an idle model can give its device memory back and take it again (POST "
                        "/v1/models/{id}/suspend|resume, /models/sleep); a router puts models to sleep instead of "
                        "unloading them")
    g.add_argument("--suspend-snapshot", choices=("pageable", "pinned"), default="pageable",
                   help="pageable: the suspended model's memory goes to host memory allocated at suspend and freed "
                        "after the resume; pinned: a page-locked block that size is reserved at load and kept "
                        "(transfers at bus speed, that much host memory for the life of the model; CUDA) "
                        "(default: pageable)")
    g.add_argument("--suspend-weights", choices=("artifact", "host"), default="artifact",
                   help="artifact: a suspended model's weights leave device memory and a resume reads them again "
                        "from the artifact, which stays open (a weight it cannot give back byte for byte is kept "
                        "on the host); host: a suspend copies the weights to host memory, in the snapshot "
                        "(as much host memory as the weights, resume at bus speed) (default: artifact)")
    g.add_argument("--no-auto-resume", action="store_true",
                   help="a suspended model is not resumed by the next request, which fails with 503")
    g.add_argument("--sleep-idle-seconds", type=integer(1), default=None, metavar="N",
                   help="put a model idle for N seconds to sleep (needs --model-suspend)")
    g.add_argument("--unload-idle-seconds", type=integer(1), default=None, metavar="N",
                   help="unload a model idle for N seconds")
