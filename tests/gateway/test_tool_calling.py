"""Tool calling over HTTP in front of the simulator, for a model whose chat template declares
tools: `auto` reads the answer for calls (the simulator's fake words hold none, so the answer is
content, whole and streamed alike), a forced call needs grammar-constrained decoding, which the
simulator honestly refuses, and a template whose call format tandem does not parse cannot take
`auto`. The calls themselves: tests/unit/test_tools.py (parsers) and
tests/functional/test_tool_calling.py (the real engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gateway.harness import MODEL, running_gateway, sse_json
from tests.tool_templates import with_chat_template

TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_time"}}]
UNKNOWN_FORMAT = (
    "{%- if tools %}Tools: {{ tools | tojson }}\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\n"
)


async def test_auto_tools_with_the_simulator_answer_content_whole_and_streamed(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> None:
    model_dir = with_chat_template(tiny_model_dir, tmp_path / "model")
    async with running_gateway(tmp_path, model_dir, sim_port, template_db=template_db) as gw:
        _, key = await gw.new_tenant("tools")
        whole = await gw.chat(key, tools=TOOLS, max_tokens=6)
        assert whole.status == 200, whole
        choice = whole.body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        assert choice["message"]["content"] and "tool_calls" not in choice["message"]

        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        reply, events = await gw.stream("/v1/chat/completions", key, {**body, "max_tokens": 6})
        assert reply.status == 200, reply
        chunks = sse_json(events)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant" and "".join(d.get("content", "") for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

        forced = await gw.chat(key, tools=TOOLS, tool_choice="required", max_tokens=6)
        assert forced.status == 400 and "grammar-constrained" in forced.error["message"], forced


async def test_a_template_whose_call_format_is_unknown_refuses_auto_but_not_none(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> None:
    model_dir = with_chat_template(tiny_model_dir, tmp_path / "model", UNKNOWN_FORMAT)
    async with running_gateway(tmp_path, model_dir, sim_port, template_db=template_db) as gw:
        _, key = await gw.new_tenant("tools")
        auto = await gw.chat(key, tools=TOOLS, max_tokens=2)
        assert auto.status == 400, auto
        assert (auto.error["code"], auto.error["param"]) == ("unsupported_parameter", "tool_choice")
        assert "format is none tandem parses" in auto.error["message"]
        none = await gw.chat(key, tools=TOOLS, tool_choice="none", max_tokens=2)
        assert none.status == 200, none
