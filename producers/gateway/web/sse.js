// Server-sent events over fetch (EventSource cannot POST or send an Authorization
// header): yields {id, data} for each event, data parsed from JSON or "[DONE]".

// The gateway writes a keep-alive after 15 s without an event (KEEPALIVE_S in
// producers/gateway/chat/watch.py). A stream silent for three of them is a connection
// that died without closing (a laptop's sleep, a NAT's dropped mapping): the browser
// would wait on it forever, so it is given up and the caller resumes.
export const STALLED_MS = 45000;

export class StalledStream extends Error {}

// `signal` aborted: the stream ends, its connection closed.
export async function* readEvents(response, signal = undefined) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const cancel = () => reader.cancel().catch(() => {});
  if (signal?.aborted) return cancel();
  signal?.addEventListener("abort", cancel, { once: true });
  let buffer = "";
  let id = null;
  let data = [];
  for (;;) {
    const { value, done } = await readWithin(reader, STALLED_MS);
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, "");
      buffer = buffer.slice(end + 1);
      if (line.startsWith("id: ")) id = line.slice(4);
      else if (line.startsWith("data: ")) data.push(line.slice(6));
      else if (line === "" && data.length) {
        const text = data.join("\n");
        yield { id, data: text === "[DONE]" ? text : JSON.parse(text) };
        data = [];
      }
    }
  }
}

async function readWithin(reader, ms) {
  let timer;
  const stalled = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new StalledStream(`nothing came for ${ms / 1000} s`)), ms);
  });
  try {
    return await Promise.race([reader.read(), stalled]);
  } catch (error) {
    if (error instanceof StalledStream) reader.cancel().catch(() => {});
    throw error;
  } finally {
    clearTimeout(timer);
  }
}
