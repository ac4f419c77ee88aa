// The openai Node SDK, as the API reference's TypeScript examples use it, against a live server.
// Usage: node openai_node.mjs SCENARIO, with B3OS_BASE_URL, B3OS_API_KEY, B3OS_MODEL and OPENAI_NODE_SDK (the
// installed package's folder, which `make test` fills) in the environment.
// Prints one JSON object: what the scenario saw, for the Python test to check.
import { pathToFileURL } from "node:url";

const { default: OpenAI } = await import(pathToFileURL(`${process.env.OPENAI_NODE_SDK}/index.mjs`).href);

const client = new OpenAI({ apiKey: process.env.B3OS_API_KEY, baseURL: process.env.B3OS_BASE_URL, maxRetries: 0 });
const model = process.env.B3OS_MODEL;
const question = [{ role: "user", content: "Name one river in Oregon." }];
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather for a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};

const scenarios = {
  async models() {
    const listed = [];
    for await (const entry of client.models.list()) listed.push(entry.id);
    const one = await client.models.retrieve(model);
    return { listed, retrieved: one.id, owned_by: one.owned_by };
  },

  async completion() {
    const completion = await client.chat.completions.create({ model, messages: question, max_tokens: 16, temperature: 0 });
    return { content: completion.choices[0].message.content, usage: completion.usage, object: completion.object };
  },

  async stream() {
    const stream = await client.chat.completions.create({
      model,
      messages: question,
      max_tokens: 16,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
    });
    let text = "";
    let usage = null;
    let finish = null;
    for await (const chunk of stream) {
      if (chunk.choices.length) {
        text += chunk.choices[0].delta.content ?? "";
        finish = chunk.choices[0].finish_reason ?? finish;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    return { text, usage, finish };
  },

  async streamHelper() {
    // The SDK's own stream helper assembles the deltas into a whole completion.
    const runner = client.chat.completions.stream({ model, messages: question, max_tokens: 16, temperature: 0 });
    let deltas = "";
    runner.on("content", (delta) => {
      deltas += delta;
    });
    const final = await runner.finalChatCompletion();
    return { deltas, content: final.choices[0].message.content, finish: final.choices[0].finish_reason };
  },

  async tools() {
    const messages = [{ role: "user", content: "What is the weather in Eugene?" }];
    const first = await client.chat.completions.create({
      model,
      messages,
      tools: [weather],
      tool_choice: { type: "function", function: { name: "get_weather" } },
      max_tokens: 48,
      temperature: 0,
    });
    const call = first.choices[0].message.tool_calls[0];
    const answer = await client.chat.completions.create({
      model,
      messages: [...messages, first.choices[0].message, { role: "tool", tool_call_id: call.id, content: "52F and raining" }],
      tools: [weather],
      max_tokens: 24,
      temperature: 0,
    });
    return {
      finish: first.choices[0].finish_reason,
      name: call.function.name,
      arguments: JSON.parse(call.function.arguments),
      answer: answer.choices[0].message.content,
    };
  },

  async schema() {
    const completion = await client.chat.completions.create({
      model,
      messages: [{ role: "user", content: "Name a city in Oregon as JSON." }],
      response_format: {
        type: "json_schema",
        json_schema: {
          name: "city",
          strict: true,
          schema: {
            type: "object",
            properties: { name: { type: "string", maxLength: 24 } },
            required: ["name"],
            additionalProperties: false,
          },
        },
      },
      max_tokens: 32,
      temperature: 0,
    });
    return { parsed: JSON.parse(completion.choices[0].message.content) };
  },

  async responses() {
    const response = await client.responses.create({
      model,
      input: "Name one river in Oregon.",
      max_output_tokens: 16,
      temperature: 0,
    });
    return { output_text: response.output_text, status: response.status, usage: response.usage };
  },

  async responsesStream() {
    const stream = client.responses.stream({
      model,
      input: "Name one river in Oregon.",
      max_output_tokens: 16,
      temperature: 0,
    });
    const types = [];
    let deltas = "";
    for await (const event of stream) {
      types.push(event.type);
      if (event.type === "response.output_text.delta") deltas += event.delta;
    }
    const final = await stream.finalResponse();
    return { types, deltas, output_text: final.output_text, status: final.status };
  },

  async responsesTool() {
    // The Responses tool round trip of the API reference: the call's items go back with their output.
    const tools = [{ type: "function", ...weather.function }];
    const question = { role: "user", content: "What is the weather in Eugene, Oregon? Use the tool." };
    const first = await client.responses.create({
      model,
      input: [question],
      tools,
      tool_choice: "required",
      max_output_tokens: 48,
      temperature: 0,
    });
    const call = first.output.find((item) => item.type === "function_call");
    const answer = await client.responses.create({
      model,
      input: [question, ...first.output, { type: "function_call_output", call_id: call.call_id, output: "52F and raining" }],
      tools,
      max_output_tokens: 24,
      temperature: 0,
    });
    return { name: call.name, arguments: JSON.parse(call.arguments), answer: answer.output_text, status: answer.status };
  },

  async error() {
    try {
      await client.chat.completions.create({ model: "b3os/no-such-model", messages: question });
      return { thrown: false };
    } catch (error) {
      return {
        thrown: true,
        kind: error.constructor.name,
        status: error.status,
        code: error.code,
        type: error.type,
        param: error.param,
        message: error.message,
        requestID: error.requestID,
      };
    }
  },

  async badKey() {
    const stranger = new OpenAI({ apiKey: "b3os_not_a_key", baseURL: process.env.B3OS_BASE_URL, maxRetries: 0 });
    try {
      await stranger.models.list();
      return { thrown: false };
    } catch (error) {
      return { thrown: true, kind: error.constructor.name, status: error.status, code: error.code, type: error.type };
    }
  },
};

const scenario = scenarios[process.argv[2]];
if (!scenario) {
  console.error(`unknown scenario ${process.argv[2]}; one of ${Object.keys(scenarios).join(", ")}`);
  process.exit(2);
}
console.log(JSON.stringify(await scenario()));
