// Drives a gateway's Ollama API with the `ollama` npm package (ollama-js) and prints one
// JSON object with what each call read back. Input (stdin, JSON): host, modules (the
// node_modules holding the pinned package), system (a long system prompt), schema (a JSON
// schema for `format`), tool (a function tool). Run by tests/clients/test_ollama_js.py.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const input = JSON.parse(readFileSync(0, "utf8"));
const pkg = join(input.modules, "ollama");
const entry = JSON.parse(readFileSync(join(pkg, "package.json"), "utf8")).exports["."].import;
const { Ollama } = await import(pathToFileURL(join(pkg, entry)).href);
const client = new Ollama({ host: input.host });
const stats = (r) => {
  const keys = ["done", "done_reason", "eval_count", "prompt_eval_count", "total_duration",
    "load_duration", "prompt_eval_duration", "eval_duration", "created_at"];
  return Object.fromEntries(keys.map((k) => [k, r[k]]));
};
const failure = async (call) => {
  try {
    const r = await call();
    if (r && r[Symbol.asyncIterator]) for await (const _ of r);
    return { thrown: false };
  } catch (e) {
    return { thrown: true, name: e.name, status_code: e.status_code, error: e.error };
  }
};
const out = { version: JSON.parse(readFileSync(join(pkg, "package.json"), "utf8")).version };

const tags = await client.list();
out.list = tags.models.map((m) => ({ name: m.name, model: m.model, family: m.details?.family }));
const show = await client.show({ model: "chat" });
out.show = { capabilities: show.capabilities, architecture: show.model_info["general.architecture"],
  context_length: show.model_info["qwen3.context_length"], family: show.details.family };
out.show_emb = (await client.show({ model: "emb" })).capabilities;

const messages = [{ role: "user", content: "Say something." }];
const options = { num_predict: 6, temperature: 0 };
const whole = await client.chat({ model: "chat", messages, options });
out.chat = { role: whole.message.role, content: whole.message.content, ...stats(whole) };
const parts = [];
for await (const part of await client.chat({ model: "chat", messages, options, stream: true })) parts.push(part);
out.chat_stream = { contents: parts.map((p) => p.message.content), dones: parts.map((p) => p.done),
  last: stats(parts.at(-1)) };

const first = await client.generate({ model: "chat", system: input.system, prompt: "Summarise the page.",
  options: { num_predict: 5, temperature: 0 } });
const second = await client.generate({ model: "chat", prompt: "And in one word?", context: first.context,
  options: { num_predict: 5, temperature: 0 } });
out.generate = [first, second].map((r) => ({ response: r.response, context: r.context, ...stats(r) }));
const gparts = [];
for await (const part of await client.generate({ model: "chat", prompt: "Tell me more.", stream: true,
  options: { num_predict: 5, temperature: 0 } })) gparts.push(part);
out.generate_stream = { responses: gparts.map((p) => p.response), last: stats(gparts.at(-1)),
  contexts: gparts.map((p) => p.context ?? null) };

const texts = ["hello world", "a much longer sentence about the tabs of a browser", "x"];
const batch = await client.embed({ model: "emb", input: texts });
const alone = [];
for (const text of texts) alone.push((await client.embed({ model: "emb", input: text })).embeddings[0]);
out.embed = { batch: batch.embeddings, alone, prompt_eval_count: batch.prompt_eval_count,
  total_duration: batch.total_duration };

// a forced call (the gateway's tool_choice, passed through by the client as it is), then its result sent back
const ask = [{ role: "user", content: "Weather in Oslo?" }];
const toolOptions = { num_predict: 60, temperature: 0 };
const called = await client.chat({ model: "chat", messages: ask, tools: [input.tool], options: toolOptions,
  tool_choice: { type: "function", function: { name: input.tool.function.name } } });
const calls = called.message.tool_calls ?? [];
const answered = await client.chat({ model: "chat", tools: [input.tool], options: { num_predict: 4, temperature: 0 },
  messages: [...ask, { role: "assistant", content: "", tool_calls: calls },
    { role: "tool", tool_name: input.tool.function.name, content: "sunny, 18 degrees" }] });
out.tools = { calls: calls.map((c) => c.function), done_reason: called.done_reason,
  answered: { content: answered.message.content, tool_calls: answered.message.tool_calls ?? null,
    ...stats(answered) } };

const json = await client.generate({ model: "chat", prompt: "JSON please", format: "json",
  options: { num_predict: 8, temperature: 0 } });
const schema = await client.chat({ model: "chat", messages: [{ role: "user", content: "Forecast?" }],
  format: input.schema, options: { num_predict: 60, temperature: 0 } });
out.format = { json: json.response, schema: schema.message.content, schema_done_reason: schema.done_reason };

const nobody = [{ role: "user", content: "hi" }];
out.errors = {
  chat: await failure(() => client.chat({ model: "no-such-model", messages: nobody })),
  chat_stream: await failure(() => client.chat({ model: "no-such-model", messages: nobody, stream: true })),
  show: await failure(() => client.show({ model: "no-such-model" })),
  embed_chat_model: await failure(() => client.embed({ model: "chat", input: "hi" })),
};
process.stdout.write(JSON.stringify(out) + "\n");
