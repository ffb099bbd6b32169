// Drives tpserve's OpenAI-compatible HTTP API with the official `openai` npm SDK.
// Usage: node openai_sdk_test.mjs --cache DIR --base-url http://HOST:PORT/v1 --model NAME
//          --mode completions|chat
// Exits non-zero with a message on the first failed check; prints "openai sdk: ok MODE" at the end.
import { createRequire } from "node:module";
import path from "node:path";
import assert from "node:assert/strict";

const args = {};
for (let i = 2; i < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, "")] = process.argv[i + 1];
const require = createRequire(path.join(path.resolve(args.cache), "package.json"));
const OpenAI = require("openai").default ?? require("openai");
const client = new OpenAI({ baseURL: args["base-url"], apiKey: "unused", maxRetries: 0, timeout: 60000 });
const model = args.model;

async function expectError(promise, status, param) {
  try {
    await promise;
  } catch (e) {
    assert.equal(e.status, status, `status of ${e}`);
    if (param !== undefined) assert.equal(e.param, param, `param of ${e}`);
    assert.ok(typeof e.message === "string" && e.message.length > 0);
    return e;
  }
  assert.fail(`expected an HTTP ${status} error`);
}

async function completions() {
  const models = await client.models.list();
  assert.ok(models.data.some((m) => m.id === model), JSON.stringify(models.data));

  const params = { model, prompt: "def fibonacci(n):", max_tokens: 12, temperature: 0 };
  const whole = await client.completions.create(params);
  assert.equal(whole.object, "text_completion");
  assert.equal(whole.choices.length, 1);
  const choice = whole.choices[0];
  assert.ok(["stop", "length"].includes(choice.finish_reason), choice.finish_reason);
  assert.ok(whole.usage.completion_tokens >= 1 && whole.usage.completion_tokens <= 12);
  assert.equal(whole.usage.total_tokens, whole.usage.prompt_tokens + whole.usage.completion_tokens);

  // Streamed, the same greedy answer arrives in pieces; the usage chunk comes last.
  const stream = await client.completions.create({ ...params, stream: true,
                                                   stream_options: { include_usage: true } });
  let text = "", finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, choice.text);
  assert.equal(finish, choice.finish_reason);
  assert.deepEqual(usage, whole.usage);
  assert.ok(chunks >= 2, `${chunks} chunks`);

  await expectError(client.completions.create({ ...params, n: 2 }), 400, "n");
  await expectError(client.completions.create({ ...params, model: "no-such-model" }), 404, "model");
  await expectError(client.completions.create({ ...params, bogus_field: 1 }), 400, "bogus_field");
}

async function chat() {
  const messages = [
    { role: "system", content: "You write Python." },
    { role: "user", content: [{ type: "text", text: "Add two numbers." }] },
  ];
  const params = { model, messages, max_tokens: 10, temperature: 0, seed: 7 };
  const whole = await client.chat.completions.create(params);
  assert.equal(whole.object, "chat.completion");
  const msg = whole.choices[0].message;
  assert.equal(msg.role, "assistant");
  assert.equal(typeof msg.content, "string");
  assert.ok(["stop", "length"].includes(whole.choices[0].finish_reason));
  assert.ok(whole.usage.completion_tokens >= 1 && whole.usage.completion_tokens <= 10);

  const stream = await client.chat.completions.create({ ...params, stream: true,
                                                        stream_options: { include_usage: true } });
  let text = "", role = null, finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      if (c.delta.content) text += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(role, "assistant");
  assert.equal(text, msg.content);
  assert.equal(finish, whole.choices[0].finish_reason);
  assert.deepEqual(usage, whole.usage);

  const lp = await client.chat.completions.create({ ...params, logprobs: true, top_logprobs: 2 });
  assert.equal(lp.choices[0].logprobs.content.length, lp.usage.completion_tokens);
  assert.equal(lp.choices[0].logprobs.content[0].top_logprobs.length, 2);

  await expectError(client.chat.completions.create({ ...params, messages: [{ role: "tool", content: "x" }] }),
                    400, "messages[0].role");
}

try {
  if (args.mode === "completions") await completions();
  else if (args.mode === "chat") await chat();
  else throw new Error(`unknown --mode ${args.mode}`);
  console.log(`openai sdk: ok ${args.mode}`);
} catch (e) {
  console.error(`openai sdk: FAILED ${args.mode}:`, e);
  process.exit(1);
}
