// Server-sent events over fetch (EventSource cannot POST or send an Authorization
// header): yields {id, data} for each event, data parsed from JSON or "[DONE]".

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
    const { value, done } = await reader.read();
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
