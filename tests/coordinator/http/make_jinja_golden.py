#!/usr/bin/env python3
"""Records what Python's jinja2 renders for the chat-template cases below, in the environment
Hugging Face transformers uses for apply_chat_template (ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, a json.dumps-based tojson, and raise_exception), into
jinja_golden.json next to this file. The C++ test (jinja_test.cc) renders the same cases with
coordinator/http/jinja.h and compares; it needs no Python.

    python3 -m venv /tmp/jv && /tmp/jv/bin/pip install jinja2 && /tmp/jv/bin/python tests/coordinator/http/make_jinja_golden.py
"""
import datetime
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Chat templates written in the styles of well-known model families.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

CHATML = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# A template in the style of those that track state across the loop with namespace().
NAMESPACE = """{%- set ns = namespace(system='', count=0, last_role=none) -%}
{%- for m in messages if m.role == 'system' -%}{%- set ns.system = ns.system ~ m.content -%}{%- endfor -%}
{%- if ns.system %}<<SYS>>{{ ns.system | trim }}<</SYS>>
{% endif -%}
{%- for m in messages | rejectattr('role', 'equalto', 'system') -%}
{%- set ns.count = ns.count + 1 -%}
{{ loop.index }}/{{ loop.length }} {{ m.role | upper }}: {{ m.content }}{% if not loop.last %}
{% endif %}
{%- set ns.last_role = m.role -%}
{%- endfor %}
[{{ ns.count }} turns, last {{ ns.last_role }}]
{%- if add_generation_prompt and ns.last_role != 'assistant' %} ASSISTANT:{% endif %}"""

# A template in the style of the harmony format (channels, a system header with the date and a
# reasoning effort, tools as a TypeScript-like namespace written by recursive macros, calls sent
# "to=functions.NAME"), as GPT-OSS models use.
HARMONY = """{#- Types of a JSON Schema, the way a TypeScript reader would write them. -#}
{%- macro ts_type(schema, depth=0) -%}
    {%- if schema.enum is defined -%}
        {{- '"' ~ schema.enum | join('" | "') ~ '"' -}}
    {%- elif schema.type == "array" -%}
        {%- if schema['items'] is defined -%}{{- ts_type(schema['items'], depth + 1) ~ "[]" -}}{%- else -%}unknown[]{%- endif -%}
    {%- elif schema.type == "object" and schema.properties -%}
        {{- "{ " -}}
        {%- for key, sub in schema.properties.items() -%}
            {{- key -}}{%- if key not in (schema.required or []) -%}?{%- endif -%}: {{ ts_type(sub, depth + 1) }}
            {%- if not loop.last %}; {% endif -%}
        {%- endfor -%}
        {{- " }" -}}
    {%- elif schema.type in ["integer", "number"] -%}number
    {%- elif schema.type is string -%}{{ schema.type }}
    {%- else -%}unknown
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_namespace(name, tools) -%}
namespace {{ name }} {
{% for t in tools %}
{%- set f = t.function %}
/* {{ f.description | default("no description", true) }} */
type {{ f.name }} = (
    {%- if f.parameters and f.parameters.properties -%}
        args: {{ ts_type(f.parameters) }}
    {%- endif -%}
) => unknown;
{% endfor %}
} // {{ name }}
{%- endmacro -%}
{%- macro header() -%}
    {%- if effort is not defined %}{% set effort = "medium" %}{% endif -%}
Model: {{ identity | default("an assistant") }}
Today: {{ strftime_now("%Y-%m-%d") }}
Effort: {{ effort }}
{%- if tools %}

Tool calls go to the commentary channel.{% endif %}
{%- endmacro -%}
<|start|>system<|message|>{{ header() }}<|end|>
{%- if messages[0].role in ["system", "developer"] %}
    {%- set first = messages[0].content %}{% set rest = messages[1:] %}
{%- else %}
    {%- set first = "" %}{% set rest = messages %}
{%- endif %}
{%- if first or tools %}<|start|>developer<|message|>
    {%- if first %}{{ first }}{% endif %}
    {%- if tools %}{% if first %}

{% endif %}{{ tool_namespace("functions", tools) }}{% endif %}<|end|>
{%- endif %}
{%- set last = namespace(call=none) %}
{%- for m in rest %}
    {%- if m.role == "assistant" and m.tool_calls %}
        {%- set call = m.tool_calls[0].function %}
        {%- if m.content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content }}<|end|>{% endif -%}
        <|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>
        {%- set last.call = call.name %}
    {%- elif m.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
    {%- elif m.role == "tool" %}
        {%- if last.call is none %}{{ raise_exception("a tool message needs an assistant call before it") }}{% endif -%}
        <|start|>functions.{{ last.call }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
    {%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "I am a model. ünïcødé ✓"},
    {"role": "user", "content": "Say \"hi\" and 'bye'\nplease"},
]
NO_SYSTEM = MESSAGES[1:]
NOW = 1796634303  # strftime_now's time (Unix seconds; UTC): a Monday
BASE = {"bos_token": "<s>", "eos_token": "</s>"}


def ctx(messages, add_generation_prompt=True, **extra):
    c = dict(BASE, messages=messages, add_generation_prompt=add_generation_prompt)
    c.update(extra)
    return c


# The tool-calling chat templates of two model families, as their tokenizer_config.json ships them
# (model data, committed under chat_templates/): Meta's Llama-3.1-8B-Instruct and Qwen's
# Qwen2.5-7B-Instruct.
TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")


def read_template(name):
    with open(os.path.join(TEMPLATE_DIR, name), encoding="utf-8") as f:
        return f.read()


LLAMA31 = read_template("llama3.1_instruct.jinja")
QWEN25 = read_template("qwen2.5_instruct.jinja")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone (ünïcødé).",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}, "precise": {"type": "boolean"}}}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
# A conversation with a call and its answer, as the server gives it to templates: each call's
# arguments parsed from OpenAI's JSON text into an object.
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}
TOOL_TURNS = [
    {"role": "system", "content": " You help travellers. "},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "{\"temperature\": 21, \"sky\": \"clear\"}", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is 21 °C and clear."},
    {"role": "user", "content": "And the time?"},
]
PARALLEL_TURNS = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL, CALL2]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "14:05", "tool_call_id": "call_2"},
]
# A tool whose arguments nest objects and arrays (the harmony-style template writes its type by
# recursion).
NESTED_TOOL = {"type": "function", "function": {
    "name": "plan_trip", "description": "",
    "parameters": {"type": "object", "properties": {
        "stops": {"type": "array", "items": {"type": "object", "properties": {
            "city": {"type": "string"}, "nights": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["museum", "beach"]}}},
            "required": ["city"]}},
        "budget": {"type": "number"}, "notes": {}},
        "required": ["stops"]}}}
LLAMA_BASE = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
HARMONY_BASE = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"}
QWEN_BASE = {"bos_token": "", "eos_token": "<|im_end|>"}


def model_ctx(base, messages, **extra):
    c = dict(base, messages=messages, add_generation_prompt=True)
    c.update(extra)
    return c


CASES = [
    ("llama3_style", LLAMA3, ctx(MESSAGES)),
    ("llama3_style_no_prompt", LLAMA3, ctx(MESSAGES, add_generation_prompt=False)),
    ("chatml_style", CHATML, ctx(MESSAGES)),
    ("chatml_style_default_system", CHATML, ctx(NO_SYSTEM)),
    ("mistral_style", MISTRAL, ctx(MESSAGES)),
    ("mistral_style_no_system", MISTRAL, ctx(NO_SYSTEM)),
    ("mistral_style_bad_roles", MISTRAL, ctx([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])),
    ("namespace_style", NAMESPACE, ctx(MESSAGES)),
    ("namespace_style_no_system", NAMESPACE, ctx(NO_SYSTEM[:2], add_generation_prompt=False)),
    # Features one by one.
    ("whitespace_control", "a  {{- ' b ' -}}  c\n  {%- if true %} d {% endif -%}\n e", {}),
    ("trim_and_lstrip_blocks", "x\n    {% if true %}\n    y\n    {% endif %}\nz\n  {# note #}\nw", {}),
    ("comment_strip", "a {#- c -#} b", {}),
    ("literals", "{{ 1 }} {{ -2 }} {{ 1.5 }} {{ 2.0 }} {{ true }} {{ none }} {{ 'q' }} {{ [1, 'a', none, false] }} {{ {'k': 'v', 'n': 1} }} {{ (1, 2) }}", {}),
    ("arithmetic", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 3 - 5 }} {{ 1.5 + 1 }}", {}),
    ("concat", "{{ 'a' ~ 1 ~ none ~ true }} {{ 'x' + 'y' }} {{ [1] + [2, 3] }} {{ '=' * 3 }}", {}),
    ("comparisons", "{{ 1 < 2 }} {{ 2 <= 1 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ 'a' != 'a' }} {{ 1 in [1, 2] }} {{ 'ell' in 'hello' }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}", {}),
    ("logic", "{{ true and false }} {{ false or 'x' }} {{ not none }} {{ 'a' if 0 else 'b' }} {{ 'yes' if [1] }}|{{ 'no' if [] }}|", {}),
    ("tests", "{{ x is defined }} {{ y is defined }} {{ y is undefined }} {{ none is none }} {{ 'a' is string }} {{ 1 is number }} {{ {} is mapping }} {{ [] is iterable }} {{ 3 is odd }} {{ 4 is even }} {{ 6 is divisibleby(3) }} {{ x is not none }} {{ 1 is eq 1 }}", {"x": 1}),
    ("filters", "{{ '  pad  ' | trim }}|{{ [1, 2, 3] | length }}|{{ 'héllo' | length }}|{{ 'abc' | upper }}|{{ 'ABC' | lower }}|{{ y | default('dflt') }}|{{ '' | default('e', true) }}|{{ ['a', 'b'] | join(', ') }}|{{ [3, 4] | first }}|{{ [3, 4] | last }}|{{ 42 | string }}|{{ '7' | int + 1 }}|{{ [1, 2] | reverse | list }}|{{ 'hello world' | title }}|{{ 'hello' | capitalize }}|{{ 'a-b' | replace('-', '+') }}", {}),
    ("tojson", "{{ obj | tojson }}|{{ 'ü\"\\n' | tojson }}|{{ obj | tojson(indent=2) }}|{{ [] | tojson }}|{{ none | tojson }}", {"obj": {"name": "f", "args": [1, 2.5, True, None], "nested": {"a": "ü"}}}),
    ("slices", "{{ xs[1:] }} {{ xs[:2] }} {{ xs[-1] }} {{ xs[::-1] }} {{ xs[1:3] }} {{ 'hello'[1:3] }} {{ 'hello'[::-1] }} {{ xs[-2:] }} {{ xs[0] }}", {"xs": [1, 2, 3, 4]}),
    ("loop_vars", "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("loop_else_and_filter", "{% for x in [] %}x{% else %}empty{% endfor %} {% for x in xs if x > 1 %}{{ x }}{% endfor %}", {"xs": [1, 2, 3]}),
    ("loop_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("scoping", "{% set x = 1 %}{% for i in [1, 2] %}{% set x = i * 10 %}{{ x }}{% endfor %}{{ x }}{% if true %}{% set x = 5 %}{% endif %}{{ x }}", {}),
    ("namespace", "{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", {}),
    ("methods", "{{ '  x  '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith('x') }}|{{ 'ab'.upper() }}|{{ d.get('k') }}|{{ d.get('z', 'none') }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ 'a b  c'.split() }}|{{ 'xxhixx'.strip('x') }}", {"d": {"k": "v"}}),
    ("selectattr_map", "{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(' ') }}|{{ ms | rejectattr('role', 'equalto', 'user') | list | length }}|{{ ms | map(attribute='role') | list }}", {"ms": MESSAGES}),
    ("message_attr_access", "{% for m in messages %}{{ m.role }}:{{ m['content'][:5] }};{% endfor %}", ctx(MESSAGES)),
    ("raise_exception", "{% if messages | length > 1 %}{{ raise_exception('Too many messages: ' ~ messages | length) }}{% endif %}ok", ctx(MESSAGES)),
    ("generation_block", "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}{% endfor %}", ctx(MESSAGES)),
    ("string_escapes", "{{ 'tab\\there' }}|{{ \"dq 'in' \" }}|{{ 'line\\nbreak' }}", {}),
    ("undefined_behaviour", "[{{ missing }}][{{ d.missing }}][{{ d['missing'] }}][{{ missing | length }}][{{ missing is defined }}]", {"d": {}}),
    ("is_test_precedence", "{{ not x is defined }} {{ x is defined and x > 0 }}", {"x": 3}),
    ("macro_arguments", "{% macro m(a, b=a ~ '!', c=none) %}[{{ a }}|{{ b }}|{{ c }}]{% endmacro %}"
     "{{ m(1) }}{{ m(1, 2) }}{{ m(b=3, a=4) }}{{ m() }}{{ m('x', c=[1]) }}", {}),
    ("macro_too_many_arguments", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}", {}),
    ("macro_unknown_keyword", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(z=2) }}", {}),
    ("macro_repeated_argument", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, a=2) }}", {}),
    ("macro_varargs_kwargs", "{% macro m(a) %}{{ a }} {{ varargs }} {{ kwargs }}{% endmacro %}{{ m(1, 2, 'x', z=3) }}|{{ m(0) }}", {}),
    ("macro_recursion", "{% macro count(n) %}{% if n > 0 %}{{ n }},{{ count(n - 1) }}{% endif %}{% endmacro %}{{ count(5) }}", {}),
    ("macro_scoping",
     "{% set top = 'early' %}{% macro show(a) %}{{ a }}/{{ top }}/{{ ctx }}/{{ loop is defined }}/{{ i }}"
     "{% set top = 'inner' %}/{{ top }}{% endmacro %}{% set top = 'late' %}"
     "{% for i in [7] %}{{ show(i) }}{% endfor %}|{{ top }}", {"ctx": "C"}),
    ("macro_defaults_from_context",
     "{% macro m() %}{% if effort is not defined %}{% set effort = 'low' %}{% endif %}{{ effort }}{% endmacro %}{{ m() }}",
     {"effort": "high"}),
    ("macro_defaults_without_context",
     "{% macro m() %}{% if effort is not defined %}{% set effort = 'low' %}{% endif %}{{ effort }}{% endmacro %}{{ m() }}", {}),
    ("macro_mutates_namespace",
     "{% set ns = namespace(n=1) %}{% macro bump(k) %}{% set ns.n = ns.n + k %}{% endmacro %}{{ bump(2) }}{{ bump(3) }}{{ ns.n }}", {}),
    ("macro_closure_in_loop", "{% for i in ['a', 'b'] %}{% macro m() %}<{{ i }}>{% endmacro %}{{ m() }}{% endfor %}", {}),
    ("macro_whitespace_and_filters",
     "{% macro m(x) -%}\n   {{ x }}  \n{%- endmacro %}\n[{{ m(1) }}][{{ m(' a ') | trim }}][{{ m('abc') | length }}][{{ m(2) ~ m(3) }}]", {}),
    ("macro_loops_inside", "{% macro m(xs) %}{% for x in xs %}{{ loop.index }}{{ x }}{% endfor %}{% endmacro %}"
     "{% for y in [1] %}{{ m(['a', 'b']) }}{{ loop.index }}{{ y }}{% endfor %}", {}),
    ("loop_controls",
     "{% for x in range(10) %}{% if x % 2 == 0 %}{% continue %}{% endif %}{% if x > 6 %}{% break %}{% endif %}{{ x }}{% endfor %}|"
     "{% for a in [1, 2] %}{% for b in [1, 2, 3] %}{% if b == 2 %}{% break %}{% endif %}{{ a }}{{ b }} {% endfor %}{% endfor %}|"
     "{% for x in [1, 2] %}{{ x }}{% break %}never{% endfor %}", {}),
    ("block_set", "{% set greeting %}Hi {{ name | upper }}!{% endset %}[{{ greeting }}][{{ greeting | length }}]"
     "{% for i in [1] %}{% set inner %}{{ i }}{% endset %}{{ inner }}{% endfor %}", {"name": "ann"}),
    ("strftime_now", "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%A %H:%M:%S') }}|"
     "{{ strftime_now is defined }}", {}),
    # The model templates: plain chat, tools offered, a call and its answer, several calls.
    ("llama3.1_plain", LLAMA31, model_ctx(LLAMA_BASE, MESSAGES)),
    ("llama3.1_tools", LLAMA31, model_ctx(LLAMA_BASE, [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)),
    ("llama3.1_tools_with_system", LLAMA31, model_ctx(LLAMA_BASE, TOOL_TURNS[:2], tools=TOOLS)),
    ("llama3.1_tool_call_and_answer", LLAMA31, model_ctx(LLAMA_BASE, TOOL_TURNS, tools=TOOLS)),
    ("llama3.1_tools_in_system", LLAMA31,
     model_ctx(LLAMA_BASE, TOOL_TURNS, tools=TOOLS, tools_in_user_message=False, date_string="01 Jan 2025")),
    ("llama3.1_parallel_calls_refused", LLAMA31, model_ctx(LLAMA_BASE, PARALLEL_TURNS, tools=TOOLS)),
    ("llama3.1_tools_no_user_message", LLAMA31, model_ctx(LLAMA_BASE, [{"role": "system", "content": "x"}], tools=TOOLS)),
    ("qwen2.5_plain", QWEN25, model_ctx(QWEN_BASE, MESSAGES)),
    ("qwen2.5_default_system", QWEN25, model_ctx(QWEN_BASE, NO_SYSTEM)),
    ("qwen2.5_tools", QWEN25, model_ctx(QWEN_BASE, [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)),
    ("qwen2.5_tool_call_and_answer", QWEN25, model_ctx(QWEN_BASE, TOOL_TURNS, tools=TOOLS)),
    ("qwen2.5_parallel_calls", QWEN25, model_ctx(QWEN_BASE, PARALLEL_TURNS, tools=TOOLS)),
    ("qwen2.5_calls_without_tools", QWEN25, model_ctx(QWEN_BASE, PARALLEL_TURNS)),
    ("harmony_style_plain", HARMONY, model_ctx(HARMONY_BASE, MESSAGES)),
    ("harmony_style_effort", HARMONY, model_ctx(HARMONY_BASE, NO_SYSTEM, effort="high", identity="a test model")),
    ("harmony_style_tools", HARMONY, model_ctx(HARMONY_BASE, [{"role": "user", "content": "Weather in Paris?"}],
                                               tools=TOOLS + [NESTED_TOOL])),
    ("harmony_style_call_and_answer", HARMONY, model_ctx(HARMONY_BASE, TOOL_TURNS, tools=TOOLS)),
    ("harmony_style_tool_without_call", HARMONY,
     model_ctx(HARMONY_BASE, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])),
]


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    # transformers' strftime_now is datetime.now().strftime; here "now" is fixed (NOW, in UTC), and
    # the C++ test renders at the same time.
    now = datetime.datetime.fromtimestamp(NOW, tz=datetime.timezone.utc)
    env.globals["strftime_now"] = lambda fmt: now.strftime(fmt)

    # transformers handles {% generation %} with an extension; a plain one that renders the body
    # stands in for it here.
    from jinja2.ext import Extension
    from jinja2 import nodes

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env.add_extension(Generation)

    out = []
    for name, template, context in CASES:
        case = {"name": name, "template": template, "context": context}
        try:
            case["output"] = env.from_string(template).render(**context)
        except (jinja2.exceptions.TemplateError, TypeError) as e:  # TypeError: a macro's arguments
            case["error"] = str(e)
        out.append(case)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jinja_golden.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"generator": "make_jinja_golden.py", "jinja2": jinja2.__version__, "now": NOW, "cases": out}, f,
                  ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(out)} cases to {path}")


if __name__ == "__main__":
    main()
