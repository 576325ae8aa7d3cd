"""Synthetic training and evaluation conversations, deterministic from a seed.

Every sample is a Chat Completions style conversation (`messages`, optional `tools`) that the
project's Qwen3.5 chat template renders; assistant turns carry a short `reasoning_content`
(the thinking block). Sample `i` of seed `s` depends only on (s, i): `random.Random("s:i")`
(string seeds hash with SHA-512, the same on every machine and Python run).

Kinds: arithmetic (digit-by-digit thinking), counting, json (answer with JSON following a given
schema), tool (call one of the declared tools with the right arguments, read the response,
answer), multi (a follow-up turn after a first exchange), refuse (tools are declared but none
applies: answer directly). Prose documents come from `ninfer_tiny.prose`.
"""

from __future__ import annotations

import functools
import json
import random
import zlib
from dataclasses import dataclass, field

CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Sydney",
          "Toronto", "Dublin", "Vienna", "Prague", "Lisbon", "Seoul", "Mumbai", "Nairobi", "Boston", "Denver"]
NAMES = ["Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "purple", "orange"]
ITEMS = ["apple", "book", "chair", "lamp", "pencil", "window", "garden", "river", "candle", "bottle",
         "rocket", "planet", "tiger", "button", "marble", "ladder", "pillow", "guitar", "basket", "mirror"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD"]
LANGS = ["French", "Spanish", "German", "Italian", "Japanese"]
SYMBOLS = ["AAPL", "MSFT", "NVDA", "AMZN", "TSLA", "IBM"]
PHRASES = ["good morning", "thank you", "where is the station", "I like tea", "see you soon"]
DATES = ["2025-03-14", "2025-06-01", "2025-07-22", "2025-09-09", "2025-11-30", "2025-12-24"]

# name, description, parameters {name: (json type, description)}, required, request templates
TOOLS = {
    "get_weather": ("Get the current weather for a city.",
                    {"city": ("string", "City name"), "unit": ("string", "celsius or fahrenheit")}, ["city"]),
    "convert_currency": ("Convert an amount of money between currencies.",
                         {"amount": ("number", "Amount to convert"), "from_currency": ("string", "ISO code"),
                          "to_currency": ("string", "ISO code")}, ["amount", "from_currency", "to_currency"]),
    "set_timer": ("Start a countdown timer.", {"minutes": ("integer", "Length in minutes"),
                                               "label": ("string", "What the timer is for")}, ["minutes"]),
    "send_email": ("Send an email.", {"to": ("string", "Recipient name"), "subject": ("string", "Subject line")},
                   ["to", "subject"]),
    "get_stock_price": ("Look up the latest price of a stock.", {"symbol": ("string", "Ticker symbol")},
                        ["symbol"]),
    "translate": ("Translate text into another language.",
                  {"text": ("string", "Text to translate"), "target_language": ("string", "Language")},
                  ["text", "target_language"]),
    "search_flights": ("Search flights between two cities on a date.",
                       {"origin": ("string", "Departure city"), "destination": ("string", "Arrival city"),
                        "date": ("string", "YYYY-MM-DD")}, ["origin", "destination", "date"]),
    "get_time": ("Get the local time in a city.", {"city": ("string", "City name")}, ["city"]),
}  # fmt: skip

SYSTEMS = [None, None, "You are a helpful assistant.", "You are a concise assistant.",
           "You are NInfer Tiny, a small helpful model."]
KINDS = ["arithmetic", "counting", "json", "tool", "multi", "refuse"]
WEIGHTS = [0.22, 0.10, 0.18, 0.26, 0.14, 0.10]


@dataclass
class Sample:
    kind: str
    messages: list[dict]
    tools: list[dict] | None = None
    # what the evaluation checks for the last assistant turn (kind-specific)
    expect: dict = field(default_factory=dict)

    def prompt_messages(self) -> list[dict]:
        """The conversation up to (not including) its last assistant turn."""
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return self.messages[:last]


def tool_schema(name: str) -> dict:
    """The OpenAI `tools` entry of one tool of TOOLS."""
    desc, params, required = TOOLS[name]
    props = {p: {"type": t, "description": d} for p, (t, d) in params.items()}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": list(required)}}}


def _assistant(content: str, reasoning: str, calls: list[tuple[str, dict]] | None = None) -> dict:
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return msg


def _with_system(r: random.Random, messages: list[dict]) -> list[dict]:
    system = r.choice(SYSTEMS)
    return ([{"role": "system", "content": system}] if system else []) + messages


# arithmetic -------------------------------------------------------------------------------------


def addition_thinking(a: int, b: int) -> str:
    """Column addition, ones then tens, as the model is taught to think."""
    steps, carry = [], 0
    x, y = a, b
    while True:  # at least one column, so 0 + 0 has a step too
        dx, dy = x % 10, y % 10
        s = dx + dy + carry
        steps.append(f"{dx} + {dy}" + (f" + {carry}" if carry else "") + f" = {s}")
        carry, x, y = s // 10, x // 10, y // 10
        if not (x or y or carry):
            break
    return "; ".join(steps) + f". So {a} + {b} = {a + b}."


def _arithmetic(r: random.Random, lo: int = 0, hi: int = 99) -> tuple[list[dict], dict]:
    op = r.choices(["+", "-", "*"], [0.7, 0.2, 0.1])[0]
    a, b = r.randint(lo, hi), r.randint(lo, hi)
    if op == "+":
        q = r.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "{a} + {b} = ?",
                      "What do you get when you add {a} to {b}?"]).format(a=a, b=b)
        think, ans = addition_thinking(a, b), a + b
    elif op == "-":
        a, b = max(a, b), min(a, b)
        q = r.choice(["What is {a} - {b}?", "Subtract {b} from {a}."]).format(a=a, b=b)
        think, ans = f"{a} - {b} = {a - b}.", a - b
    else:
        a, b = r.randint(2, 12), r.randint(2, 12)
        q = f"What is {a} times {b}?"
        think, ans = f"{a} * {b} = {a * b}.", a * b
    answer = r.choice(["{a} {op} {b} = {n}.", "The answer is {n}.", "{n}"]).format(a=a, b=b, op=op, n=ans)
    return [{"role": "user", "content": q}, _assistant(answer, think)], {"answer": ans, "a": a, "b": b, "op": op}


def _counting(r: random.Random) -> tuple[list[dict], dict]:
    if r.random() < 0.5:
        word = r.choice(ITEMS)
        letter = r.choice(sorted(set(word)))
        n = word.count(letter)
        q = f'How many times does the letter "{letter}" appear in "{word}"?'
        think = f"{'-'.join(word)}. The letter {letter} appears {n} time{'s' if n != 1 else ''}."
        answer = f'"{letter}" appears {n} time{"s" if n != 1 else ""} in "{word}".'
    else:
        words = r.sample(ITEMS + COLORS, r.randint(2, 7))
        n = len(words)
        q = f"How many words are in this list: {', '.join(words)}?"
        think = " ".join(f"{i + 1} {w}" for i, w in enumerate(words)) + f". That is {n}."
        answer = f"There are {n} words."
    return [{"role": "user", "content": q}, _assistant(answer, think)], {"answer": n}


# JSON -------------------------------------------------------------------------------------------

_FIELDS = {
    "name": ("string", lambda r: r.choice(NAMES)),
    "age": ("integer", lambda r: r.randint(5, 90)),
    "city": ("string", lambda r: r.choice(CITIES)),
    "color": ("string", lambda r: r.choice(COLORS)),
    "item": ("string", lambda r: r.choice(ITEMS)),
    "count": ("integer", lambda r: r.randint(0, 50)),
    "price": ("number", lambda r: round(r.randint(100, 9999) / 100, 2)),
    "in_stock": ("boolean", lambda r: r.random() < 0.5),
}
_PHRASE = {"name": "{v} is the name", "age": "the age is {v}", "city": "the city is {v}",
           "color": "the color is {v}", "item": "the item is a {v}", "count": "there are {v} of them",
           "price": "the price is {v}", "in_stock": "it is {neg}in stock"}


def json_schema_of(fields: list[str]) -> dict:
    return {"type": "object", "properties": {f: {"type": _FIELDS[f][0]} for f in fields},
            "required": list(fields)}


def _json(r: random.Random) -> tuple[list[dict], dict]:
    fields = r.sample(sorted(_FIELDS), r.randint(2, 4))
    values = {f: _FIELDS[f][1](r) for f in fields}
    schema = json_schema_of(fields)
    facts = [_PHRASE[f].format(v=values[f], neg="" if values[f] is True else "not ") for f in fields]
    r.shuffle(facts)
    q = (f"Reply with only a JSON object that follows this schema:\n{json.dumps(schema)}\n"
         f"Facts: {'; '.join(facts)}.")
    think = "Fields: " + ", ".join(fields) + "."
    answer = json.dumps(values)
    return [{"role": "user", "content": q}, _assistant(answer, think)], {"schema": schema, "values": values}


# tools ------------------------------------------------------------------------------------------


def _tool_request(r: random.Random, name: str) -> tuple[str, dict, str, str]:
    """(user request, arguments, tool response JSON, final answer) for one tool."""
    if name == "get_weather":
        city = r.choice(CITIES)
        args = {"city": city}
        if r.random() < 0.3:
            args["unit"] = r.choice(["celsius", "fahrenheit"])
        t = r.randint(-5, 35)
        q = r.choice(["What's the weather in {c}?", "Is it cold in {c} right now?", "Weather for {c} please."])
        return q.format(c=city), args, json.dumps({"city": city, "temperature": t, "sky": r.choice(
            ["sunny", "cloudy", "rainy"])}), f"It is {t} degrees in {city}."
    if name == "convert_currency":
        amt, a, b = r.randint(1, 500), *r.sample(CURRENCIES, 2)
        res = round(amt * r.uniform(0.5, 1.5), 2)
        return (f"Convert {amt} {a} to {b}.", {"amount": amt, "from_currency": a, "to_currency": b},
                json.dumps({"result": res}), f"{amt} {a} is about {res} {b}.")
    if name == "set_timer":
        m = r.randint(1, 60)
        args = {"minutes": m}
        q = f"Set a timer for {m} minutes."
        if r.random() < 0.4:
            args["label"] = r.choice(["tea", "pasta", "laundry", "break"])
            q = f"Set a {m} minute timer for the {args['label']}."
        return q, args, json.dumps({"ok": True}), f"Your {m} minute timer is running."
    if name == "send_email":
        to, subj = r.choice(NAMES), r.choice(["Lunch", "Meeting notes", "Hello", "The report", "Tomorrow"])
        return (f"Email {to} with the subject \"{subj}\".", {"to": to, "subject": subj},
                json.dumps({"sent": True}), f"I sent the email to {to}.")
    if name == "get_stock_price":
        s, p = r.choice(SYMBOLS), round(r.uniform(10, 900), 2)
        return (r.choice(["What is {s} trading at?", "Price of {s} stock?"]).format(s=s), {"symbol": s},
                json.dumps({"symbol": s, "price": p}), f"{s} is at {p}.")
    if name == "translate":
        text, lang = r.choice(PHRASES), r.choice(LANGS)
        return (f'Translate "{text}" into {lang}.', {"text": text, "target_language": lang},
                json.dumps({"translation": f"[{lang}] {text}"}), f"In {lang}: [{lang}] {text}")
    if name == "search_flights":
        o, d = r.sample(CITIES, 2)
        date = r.choice(DATES)
        n = r.randint(0, 5)
        return (f"Find flights from {o} to {d} on {date}.", {"origin": o, "destination": d, "date": date},
                json.dumps({"flights": n}), f"I found {n} flights from {o} to {d} on {date}.")
    city, hh, mm = r.choice(CITIES), r.randint(0, 23), r.randint(0, 59)
    return (f"What time is it in {city}?", {"city": city}, json.dumps({"time": f"{hh:02d}:{mm:02d}"}),
            f"It is {hh:02d}:{mm:02d} in {city}.")


def _toolset(r: random.Random, must: str | None) -> list[str]:
    names = r.sample(sorted(TOOLS), r.randint(1, 4))
    if must and must not in names:
        names[r.randrange(len(names))] = must
    return names


def _tool(r: random.Random, answer_after: bool = True) -> tuple[list[dict], list[dict], dict]:
    name = r.choice(sorted(TOOLS))
    tools = _toolset(r, name)
    q, args, resp, final = _tool_request(r, name)
    msgs = [{"role": "user", "content": q},
            _assistant("", f"The user wants {TOOLS[name][0][:-1].lower()}. I will call {name}.", [(name, args)])]
    expect = {"name": name, "arguments": args}
    if answer_after:
        msgs += [{"role": "tool", "content": resp}, _assistant(final, "I have the result.")]
    return msgs, [tool_schema(t) for t in tools], expect


_CHAT = [("Tell me something about {i}s.", "A {i} is a common thing; people use it every day."),
         ("Say hello.", "Hello! How can I help you today?"),
         ("What is your name?", "I am NInfer Tiny, a small language model."),
         ("Write one sentence about the color {c}.", "The color {c} can be bright or calm."),
         ("Thank you!", "You are welcome.")]


def _refuse(r: random.Random) -> tuple[list[dict], list[dict], dict]:
    tools = [tool_schema(t) for t in _toolset(r, None)]
    if r.random() < 0.5:
        msgs, exp = _arithmetic(r)
        msgs[1]["reasoning_content"] = "No tool is needed. " + msgs[1]["reasoning_content"]
        return msgs, tools, exp
    q, a = r.choice(_CHAT)
    i, c = r.choice(ITEMS), r.choice(COLORS)
    msgs = [{"role": "user", "content": q.format(i=i, c=c)},
            _assistant(a.format(i=i, c=c), "No tool fits. I answer directly.")]
    return msgs, tools, {}


def _multi(r: random.Random) -> tuple[list[dict], list[dict] | None, dict]:
    if r.random() < 0.5:
        first, _ = _arithmetic(r)
        second, exp = _arithmetic(r)
        second[0]["content"] = r.choice(["And ", "Now: ", "Next, ", ""]) + second[0]["content"]
        return first + second, None, exp
    first, tools, _ = _tool(r)
    name = first[1]["tool_calls"][0]["function"]["name"]
    q, args, resp, final = _tool_request(r, name)
    second = [{"role": "user", "content": "Also: " + q},
              _assistant("", f"Another request for {name}.", [(name, args)]),
              {"role": "tool", "content": resp}, _assistant(final, "I have the result.")]
    return first + second, tools, {"name": name, "arguments": args}


HELD_OUT_BUCKETS = 16


def held_out(messages: list[dict]) -> bool:
    """Whether a conversation belongs to the evaluation side: its last user prompt hashes to bucket 0.

    Training samples never fall in that bucket and evaluation samples always do, so no
    evaluation prompt is ever a training prompt.
    """
    last = [m["content"] for m in messages if m["role"] == "user"][-1]
    return zlib.crc32(last.encode()) % HELD_OUT_BUCKETS == 0


def make_sample(seed: int, index: int, kind: str | None = None, evaluation: bool = False) -> Sample:
    """Sample `index` of the stream of `seed` (a kind drawn by WEIGHTS unless given).

    Draws are repeated (deterministically) until the sample is on the requested side of `held_out`.
    """
    for attempt in range(1000):
        s = _draw(random.Random(f"{seed}:{index}:{attempt}" if attempt else f"{seed}:{index}"), kind)
        if held_out(s.messages) == evaluation:
            return s
    raise RuntimeError("no sample on the requested side of the held-out split")


def _draw(r: random.Random, kind: str | None) -> Sample:
    kind = kind or r.choices(KINDS, WEIGHTS)[0]
    tools = None
    if kind == "arithmetic":
        msgs, exp = _arithmetic(r)
    elif kind == "counting":
        msgs, exp = _counting(r)
    elif kind == "json":
        msgs, exp = _json(r)
    elif kind == "tool":
        msgs, tools, exp = _tool(r, answer_after=r.random() < 0.8)
    elif kind == "multi":
        msgs, tools, exp = _multi(r)
    elif kind == "refuse":
        msgs, tools, exp = _refuse(r)
    else:
        raise ValueError(f"unknown sample kind {kind!r}")
    return Sample(kind, _with_system(r, msgs), tools, exp)


@functools.lru_cache(maxsize=1)
def project_template():
    """The project's Qwen3.5 chat template, compiled once."""
    from ninfer_qwen35.chat import QWEN35_TEMPLATE

    from ninfer_core.tokenizer.chat_template import ChatTemplate

    return ChatTemplate(QWEN35_TEMPLATE)


def render(sample: Sample, template=None) -> str:
    """The sample as the chat template renders a finished conversation."""
    template = template or project_template()
    return template.render(sample.messages, tools=sample.tools, add_generation_prompt=False)


def render_ids(sample: Sample, tokenizer, template=None) -> list[int]:
    """Token ids of the rendered conversation (markup as control tokens, data as plain text)."""
    template = template or project_template()
    return template.render_ids(tokenizer, sample.messages, tools=sample.tools, add_generation_prompt=False)


def eval_prompts(seed: int, per_kind: int) -> list[Sample]:
    """Held-out evaluation samples: tool calls (no answer after), JSON, and two-number additions."""
    out = []
    for i in range(per_kind):
        for kind in ("tool", "json", "addition"):
            for attempt in range(1000):
                r = random.Random(f"eval-{kind}:{seed}:{i}:{attempt}")
                if kind == "tool":
                    msgs, tools, exp = _tool(r, answer_after=False)
                    s = Sample("tool", _with_system(r, msgs), tools, exp)
                elif kind == "json":
                    msgs, exp = _json(r)
                    s = Sample("json", _with_system(r, msgs), None, exp)
                else:
                    a, b = r.randint(0, 99), r.randint(0, 99)
                    q = r.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]).format(a=a, b=b)
                    s = Sample("addition", [{"role": "user", "content": q},
                                            _assistant(str(a + b), addition_thinking(a, b))], None,
                               {"answer": a + b, "a": a, "b": b, "op": "+"})
                if held_out(s.messages):
                    out.append(s)
                    break
    return out
