// The gateway's HTTP API with the signed-in key; errors become ApiError with the
// status, the server's message and, for 429, when to retry.

export class ApiError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

export class Api {
  constructor(key) {
    this.key = key;
  }

  async request(method, path, body, extraHeaders = {}, signal = undefined) {
    const headers = { Authorization: `Bearer ${this.key}`, ...extraHeaders };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
      });
    } catch (error) {
      if (signal?.aborted) throw error; // the page left it: no error to show
      throw new ApiError(0, "The gateway cannot be reached. Check your connection and retry.");
    }
    if (!response.ok) throw await apiError(response);
    return response;
  }

  async json(method, path, body) {
    const response = await this.request(method, path, body);
    return response.status === 204 ? null : response.json();
  }
}

async function apiError(response) {
  // HTTP/2 has no reason phrase: a proxy's HTML 502 there read ".".
  let message = response.statusText || `HTTP ${response.status}`;
  try {
    message = (await response.json()).error.message;
  } catch {
    // not JSON: keep the status text
  }
  const retryAfter = Number(response.headers.get("Retry-After")) || null;
  return new ApiError(response.status, message, retryAfter);
}

// Each error in plain words, once: the gateway's messages end with "retry in N s" where
// a wait applies, which becomes the page's own "Try again in N seconds."
export function explain(error) {
  if (!(error instanceof ApiError)) return `Something went wrong: ${error.message}`;
  const message = withoutRetry(error.message);
  switch (error.status) {
    case 0: // no answer at all: the page's own words, whole
      return error.message;
    case 401:
      return "Your API key was not accepted. Sign in again.";
    case 413:
      return `That message is too long for the model: ${message}.`;
    case 429:
      return `Too many requests: ${message}. ${retryIn(error.retryAfter)}`;
    case 503:
      return `The service is busy or unavailable: ${message}. ${retryIn(error.retryAfter)}`;
    default:
      return `${message}.`;
  }
}

// "...; retry in 10 s", "...; retry (another replica answers)", "..., please retry"
function withoutRetry(message) {
  return message.replace(/[;,:.]?\s*(please\s+)?retry\b[^;]*$/i, "").replace(/\.$/, "");
}

function retryIn(seconds) {
  if (!seconds) return "Try again in a few seconds.";
  return `Try again in ${seconds} second${seconds === 1 ? "" : "s"}.`;
}
