"""The rules on a plugin's serve options and on speculative backends (`RULES` in
ninfer_core.contract): each raises `ContractError` naming the rule."""

from __future__ import annotations

from pathlib import Path

from ninfer_core.contract import ContractError, SpecContract


def options_parsed(contract, case: str) -> None:
    """Every option the plugin adds parses in the real `ninfer serve` parser: absent (its default),
    and given (an example value: `option_examples`, else its choices, else its default, else the
    bare flag of a store_true/store_false option)."""
    import pytest

    from ninfer_core.cli import _serve_parser, build_parser
    from ninfer_core.plugins import PluginHost, PluginSelection

    rule = "options-parsed"
    if contract.plugin is None:
        pytest.skip("the contract names no plugin module")
    host = PluginHost(PluginSelection(names=[contract.plugin], autoload=False))
    mine = [o for o in host.serve_options() if o.plugin == contract.plugin]
    if not mine:
        pytest.skip(f"plugin {contract.plugin} adds no serve options")
    serve = _serve_parser(build_parser(host))

    def parse(argv: list[str]):
        try:
            ns, rest = serve.parse_known_args(argv)
        except SystemExit as e:  # argparse reports on stderr, then exits
            raise ContractError(rule, case, f"`ninfer serve {' '.join(argv)}` is refused (exit {e.code})") from None
        if rest:
            raise ContractError(rule, case, f"`ninfer serve {' '.join(argv)}` leaves {rest} unparsed")
        return ns

    for opt in mine:  # argparse converts a string default at every parse: name the option here
        default, conv = opt.kwargs.get("default"), opt.kwargs.get("type")
        if isinstance(default, str) and callable(conv):
            try:
                conv(default)
            except Exception as e:  # noqa: BLE001 - any converter error
                raise ContractError(rule, case, f"{opt.flags[0]} default {default!r} does not parse: {e}") from None
    base = parse([])
    for opt in mine:
        flag = next((f for f in opt.flags if f.startswith("--")), opt.flags[0])
        if not opt.kwargs.get("help"):
            raise ContractError(rule, case, f"{flag} has no help text (`ninfer serve --help` lists it)")
        if not hasattr(base, opt.dest) or getattr(base, opt.dest) != opt.kwargs.get("default", getattr(base, opt.dest)):
            raise ContractError(rule, case, f"{flag} absent does not leave its default in {opt.dest!r}")
        action = opt.kwargs.get("action")
        examples = contract.option_examples.get(flag)
        if examples is None:
            if action in ("store_true", "store_false", "count"):
                examples = [[]]
            elif opt.kwargs.get("choices"):
                examples = [[str(c)] for c in opt.kwargs["choices"]]
            elif opt.kwargs.get("default") is not None:
                examples = [[str(opt.kwargs["default"])]]
            else:
                raise ContractError(rule, case, f"{flag} has no default, choices or example value: give one in "
                                                "RunnerContract/SpecContract option_examples")
        else:
            examples = [[v] if isinstance(v, str) else list(v) for v in examples]
        for values in examples:
            ns = parse([flag, *values])
            if action == "store_true" and getattr(ns, opt.dest) is not True:
                raise ContractError(rule, case, f"{flag} given does not set {opt.dest!r}")


def _engine_tokens(rule: str, case: str, runner, backend, prompts, max_tokens: int, watch=None) -> list[list[int]]:
    """Greedy output ids of each prompt through a real Engine (two lanes); a request that ends in an
    error event fails `rule` with that error."""
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.testing import collect, run_async

    if watch is not None and backend is not None:
        inner = backend.propose

        def propose(lanes):
            out = inner(lanes)
            watch(lanes, out)
            return out

        backend.propose = propose

    async def go():
        eng = Engine(runner, _IdTokenizer(int(runner.info.vocab_size)), EngineOptions(max_context=512, prefill_chunk=32, max_concurrency=2),
                     spec=backend)
        eng.start()
        try:
            hs = [eng.submit(GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0),
                                               max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
            return [await collect(h) for h in hs]
        finally:
            eng.shutdown(timeout=60)

    outcomes = run_async(go(), timeout=600)
    for i, out in enumerate(outcomes):
        if out.error is not None:
            raise ContractError(rule, case, f"prompt {i} failed in the engine: {out.error}")
    return [out.token_ids for out in outcomes]


class _IdTokenizer:
    """Ids as text: the engine needs bytes per token, the rules compare ids only."""

    eos_token_ids = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def token_bytes(self, t):
        return b""

    def is_special(self, t):
        return False

    def decode(self, ids, skip_special=True):
        return ""


def _prompts(contract: SpecContract, vocab: int) -> list[list[int]]:
    import torch

    high = min(vocab, contract.token_high or vocab)
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, high, (contract.prompt_tokens,), generator=g).tolist()
    return [base, base[: contract.prompt_tokens // 2] + base[:6]]


def spec_proposals_in_bounds(contract: SpecContract, case: str, workdir: Path) -> None:
    rule = "spec-proposals-in-bounds"
    runner, backend = contract.load(workdir)
    vocab = int(runner.info.vocab_size)
    seen: list[int] = []
    broken: list[str] = []  # found on the engine's worker thread, raised here

    def watch(lanes, proposals):
        if len(proposals) != len(lanes):
            broken.append(f"{len(proposals)} proposals for {len(lanes)} lanes")
        for lane, p in zip(lanes, proposals):
            toks = list(p.tokens)
            if len(toks) > lane.max_drafts:
                broken.append(f"{len(toks)} drafts for a lane allowed {lane.max_drafts}")
            bad = [t for t in toks if not 0 <= int(t) < vocab]
            if bad:
                broken.append(f"draft ids {bad} outside the vocabulary of {vocab}")
            seen.append(len(toks))

    try:
        _engine_tokens(rule, case, runner, backend, _prompts(contract, vocab), contract.max_tokens, watch)
    finally:
        if broken:
            raise ContractError(rule, case, broken[0])
    if not any(seen):
        raise ContractError(rule, case, "the backend proposed no draft in a whole greedy run")


def spec_greedy_unchanged(contract: SpecContract, case: str, workdir: Path) -> None:
    rule = "spec-greedy-unchanged"
    runner, backend = contract.load(workdir)
    plain_runner, _ = contract.load(workdir)
    prompts = _prompts(contract, int(runner.info.vocab_size))
    got = _engine_tokens(rule, case, runner, backend, prompts, contract.max_tokens)
    plain = _engine_tokens(rule, case, plain_runner, None, prompts, contract.max_tokens)
    for i, (a, b) in enumerate(zip(got, plain)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ContractError(rule, case, f"prompt {i}: output differs from plain greedy at token {at} "
                                            f"({a[at:at + 4]} against {b[at:at + 4]})")
