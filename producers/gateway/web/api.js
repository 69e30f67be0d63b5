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

  async request(method, path, body, extraHeaders = {}) {
    const headers = { Authorization: `Bearer ${this.key}`, ...extraHeaders };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch {
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
  let message = response.statusText;
  try {
    message = (await response.json()).error.message;
  } catch {
    // not JSON: keep the status text
  }
  const retryAfter = Number(response.headers.get("Retry-After")) || null;
  return new ApiError(response.status, message, retryAfter);
}

export function explain(error) {
  if (!(error instanceof ApiError)) return `Something went wrong: ${error.message}`;
  switch (error.status) {
    case 401:
      return "Your API key was not accepted. Sign in again.";
    case 413:
      return `That message is too long for the model: ${error.message}`;
    case 429:
      return `Too many requests: ${error.message}. Try again in ${error.retryAfter ?? "a few"} seconds.`;
    case 503:
      return `The service is busy or unavailable: ${error.message}`;
    default:
      return error.message;
  }
}
