"""What the client tests share: the served model, the environment that keeps the clients
off the network, the weather tool and the structured results.

Everything a random-weight model must write is bounded, so that a grammar-constrained
answer finishes within ``max_tokens``: the tool's ``city`` (``maxLength``), the
:class:`Report` (``maxLength``, ``minimum``/``maximum``). Anthropic's SDK moves such
constraints into descriptions for ``output_config.format`` (``anthropic.transform_schema``),
so JSON-schema answers on the Messages API use :class:`Forecast`, bounded by its types alone.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from gateway.models.demo_model import ARCH_CONFIGS

MODEL = "mlx-gateway-demo"  # the name `--model demo` is served as
CONTEXT = ARCH_CONFIGS["qwen3"]["max_position_embeddings"]  # the demo model's context (tokens)
MAX_TOKENS = 160  # --max-tokens of the server; every test also sends its own

# Remote lookups the client libraries would otherwise make (conftest.py sets these in the
# test process before the libraries are imported).
QUIET_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm: the bundled cost map, not a download
    "OPENAI_AGENTS_DISABLE_TRACING": "1",  # openai-agents: no trace export to api.openai.com
    "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false",  # langchain: no LangSmith
}
# For subprocesses (the server, the llm CLI): no hub either, and any HTTP(S) client that
# honours proxies gets a dead one, loopback excepted.
DEAD_PROXY = "http://127.0.0.1:9"
OFFLINE_ENV = {**QUIET_ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "ALL_PROXY": DEAD_PROXY,
               "http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY, "all_proxy": DEAD_PROXY,
               "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

City = Annotated[str, Field(max_length=12)]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


class Report(BaseModel):
    """A weather report."""

    city: str = Field(max_length=12)
    degrees: int = Field(ge=-50, le=50)


class Forecast(BaseModel):
    """A forecast whose JSON is bounded by its types."""

    sky: Literal["sun", "rain", "snow"]
    windy: bool


def weather_tool(calls: list):
    """A ``get_weather(city)`` function that appends each ``city`` to ``calls``."""

    def get_weather(city: City) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"sunny, 18 degrees in {city}"

    return get_weather
