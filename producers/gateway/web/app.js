// The chat page: sign in with an API key, conversations in the sidebar, replies
// streamed over server-sent events and rendered as they arrive.

import { Api, ApiError, explain } from "/web/api.js";
import { addCodeCopyButtons, copyButton } from "/web/copy.js";
import { renderMarkdown, escapeHtml } from "/web/markdown.js";
import { readEvents } from "/web/sse.js";
import { renderUsage } from "/web/usage.js";

const KEY_STORAGE = "tandoor.apiKey";
const RESUME_TRIES = 5;
const STORED_TRIES = 5; // a finished reply not stored yet: look again each second
// A new chat's title until the model names it: its first message's opening characters,
// counted as the gateway counts them (code points). The gateway stores them as redacted
// (no addresses or numbers) and then asks the model for a title; the page shows them
// as typed meanwhile.
const AUTO_TITLE_CHARS = 60; // producers/gateway/conversations/protocol.py
// After a new chat's first reply the model's title comes from a background job, in the
// lowest band: the sidebar (and the header) look again, less and less often.
const TITLE_CHECK_FIRST_MS = 2000;
const TITLE_CHECK_MAX_MS = 30000;
const TITLE_CHECKS = 40;
const USAGE_REFRESH_MS = 10000;
const STOP_GRACE_MS = 3000; // a stop answered "none running": the reply's end comes within
const NEAR_BOTTOM_PX = 40;
const PAGE = 30; // chats the sidebar lists at first, and adds with each "Load more"
const MAX_PAGE = 100; // the most the gateway gives in one page
const ANSWERED = new Set(["stop", "length"]); // finish reasons of a reply that ran
const $ = (id) => document.getElementById(id);

const state = {
  api: null,
  cursor: null,
  conversation: null, // {id, title, model, messages}
  wanted: null, // the chat last chosen (its answer may still be on the way)
  stopAsked: false, // Stop pressed while the message's new chat was being created
  reply: null, // the open chat's reply streaming now (newReply)
  busy: false, // sending or streaming: the composer waits
  following: true, // the list is scrolled to its end: a streaming reply keeps it there
  pinnedAt: 0, // the scrollTop the page last set: below it, the reader has scrolled up
  modelNames: new Map(), // served name -> display name
  usageTimer: null,
};
const sources = new WeakMap(); // a body -> its text as sent or its Markdown (copy, Edit)

// ---- signing in -------------------------------------------------------------

async function signIn(key) {
  const api = new Api(key);
  const models = await api.json("GET", "/v1/models");
  state.api = api;
  sessionStorage.setItem(KEY_STORAGE, key);
  state.modelNames = new Map(models.data.map((m) => [m.id, m.display_name || m.id]));
  $("model-picker").replaceChildren(
    ...models.data.map((m) => new Option(state.modelNames.get(m.id), m.id)),
  );
  $("signin").hidden = true;
  $("app").hidden = false;
  showConversation(null);
  await loadConversations(true);
  $("prompt").focus();
}

function signOut() {
  sessionStorage.removeItem(KEY_STORAGE);
  location.reload();
}

// ---- the sidebar --------------------------------------------------------------

async function loadConversations(reset) {
  const list = $("conversation-list");
  const shown = [...list.querySelectorAll("button")].map((b) => b.dataset.id);
  // Read again (a reply ended, a chat renamed): as many as were listed, or the pages
  // "Load more" had added went, and it had to be clicked again.
  const rows = reset ? await firstConversations(shown.length) : await nextConversations();
  if (reset) {
    // Rebuilt when a reply ends: a keyboard reader moving through the list kept their
    // place only if it is given back (the focus fell to the page's top).
    const focused = list.contains(document.activeElement) ? document.activeElement.dataset.id : null;
    list.replaceChildren(...rows.map(sidebarItem)); // at once: no flicker
    if (focused) list.querySelector(`button[data-id="${CSS.escape(focused)}"]`)?.focus();
  } else {
    // A page asked for before the list was reloaded (a reply ended) overlaps it.
    const listed = new Set(shown);
    list.append(...rows.filter((c) => !listed.has(c.id)).map(sidebarItem));
  }
  $("more-conversations").hidden = !state.cursor;
  markCurrent();
  const current = state.conversation && rows.find((c) => c.id === state.conversation.id);
  // Renamed, or titled by the model, meanwhile. Untitled while its first reply runs: the
  // list was read before the message (and its title) was stored; the header keeps the
  // opening words typed.
  if (current && (current.title || !state.busy)) setTitle(current.title);
}

async function conversationsPage(limit, cursor) {
  const query = new URLSearchParams({ limit: String(limit) });
  if (cursor) query.set("cursor", cursor);
  const page = await state.api.json("GET", `/v1/conversations?${query}`);
  state.cursor = page.next_cursor;
  return page.data;
}

async function firstConversations(count) {
  const rows = new Map(); // by id: a chat that moved up meanwhile is read twice
  let cursor = null;
  do {
    const wanted = Math.min(MAX_PAGE, Math.max(PAGE, count - rows.size));
    for (const c of await conversationsPage(wanted, cursor)) {
      if (!rows.has(c.id)) rows.set(c.id, c);
    }
    cursor = state.cursor;
  } while (cursor && rows.size < count);
  return [...rows.values()];
}

async function nextConversations() {
  return state.cursor ? conversationsPage(PAGE, state.cursor) : [];
}

// One page at a time: a double click asked for the same page twice, shown twice.
async function loadMore() {
  const more = $("more-conversations");
  if (more.disabled) return;
  more.disabled = true;
  try {
    await loadConversations(false);
  } finally {
    more.disabled = false;
  }
}

// The Enter that commits an input method's composition (Japanese, Chinese, Korean),
// or the Escape that cancels it, is the input method's, not a send or a stop.
function composing(e) {
  return e.isComposing || e.keyCode === 229;
}

function setTitle(title) {
  state.conversation.title = title;
  $("chat-title").textContent = title || "New chat";
}

// Until the conversation's title changes from `provisional`, while it stays open and
// unrenamed; then the sidebar shows it too.
async function watchTitle(id, provisional) {
  const unchanged = () => state.conversation?.id === id && state.conversation.title === provisional;
  let wait = TITLE_CHECK_FIRST_MS;
  for (let check = 0; check < TITLE_CHECKS && unchanged(); check++) {
    await sleep(wait);
    wait = Math.min(wait * 1.5, TITLE_CHECK_MAX_MS);
    if (!unchanged()) return;
    const found = await state.api.json("GET", `/v1/conversations/${id}`).catch(() => null);
    if (found && found.title !== provisional && unchanged()) {
      setTitle(found.title);
      await loadConversations(true).catch(() => {});
      return;
    }
  }
}

function sidebarItem(conversation) {
  const button = document.createElement("button");
  button.type = "button";
  // Untitled: its first message was refused (a chat is named as that message is stored).
  button.textContent = conversation.title || "Untitled chat";
  button.dataset.id = conversation.id;
  button.addEventListener("click", () => {
    // The open chat, while a message is sent to it: read from the store, which may not
    // hold the message yet, the question vanished and its reply streamed unseen.
    // Still chosen last: a chat clicked before it, loading yet, is not shown over it.
    state.wanted = conversation.id;
    if (state.busy && state.conversation?.id === conversation.id) return;
    openConversation(conversation.id).catch((error) => notOpened(conversation.id, error));
  });
  const item = document.createElement("li");
  item.append(button);
  return item;
}

function markCurrent() {
  for (const button of $("conversation-list").querySelectorAll("button")) {
    const current = state.conversation && button.dataset.id === state.conversation.id;
    button.setAttribute("aria-current", current ? "true" : "false");
  }
}

// A chat clicked that did not open: the chat on screen stays the one the composer sends
// to (the follow-up typed there went to the chat that failed). Gone meanwhile: it leaves
// the sidebar, and the chat on screen stays open (it was closed, its reply cut).
function notOpened(id, error) {
  if (state.wanted === id) state.wanted = state.conversation?.id ?? null;
  if (isGone(error) && state.conversation?.id !== id) {
    loadConversations(true).catch(() => {});
    say(error);
    return;
  }
  notify(error);
}

// ---- one conversation ---------------------------------------------------------

// Shown only if it is still the chat last chosen: picked B then C, B's slower answer
// showed B, and the composer sent to it.
// `shown`: called once the chat is on screen, before its running reply is followed.
async function openConversation(id, resume = true, notice = null, shown = null) {
  const conversation = await state.api.json("GET", `/v1/conversations/${id}`);
  if (state.wanted !== id) return;
  showConversation(conversation);
  if (notice) notify(notice); // after: showing a chat hides the notice
  shown?.();
  if (resume && awaitsReply(conversation) && !following(id)) await resumeReply();
}

// Its reply is streaming here already: clicked twice, the chat ran a second reader, and
// the reply showed twice.
function following(id) {
  return Boolean(state.reply && !state.reply.left && state.reply.conversationId === id);
}

// Another tab's reply runs in this chat: refused here, where no Stop showed.
function runsElsewhere(error) {
  return error instanceof ApiError && error.status === 409 && error.message.startsWith("a reply is being generated");
}

// By what is shown: a regenerated reply's question was followed by the reply it replaces
// (hidden), and the chat reopened while the new one ran showed no reply and no Stop.
function awaitsReply(conversation) {
  const last = visible(conversation).at(-1);
  return Boolean(last && last.role === "user" && last.status === "sent");
}

// No reply runs any more: show it once it is stored (persistence may lag a moment),
// never asking for the stream again (a reply that never came looped here, request
// after request).
async function showWhenStored(id) {
  for (let tries = 0; tries < STORED_TRIES && state.wanted === id; tries++) {
    await openConversation(id, false);
    if (!awaitsReply(state.conversation)) return;
    await sleep(1000);
  }
  // Left with the question and no word of why, sending it again stored it twice.
  if (state.wanted === id) notify(new ApiError(0, NO_REPLY_YET));
}

const NO_REPLY_YET = "No reply to your last message yet. Reopen the chat later to see it, or press Regenerate.";

function showConversation(conversation) {
  state.wanted = conversation ? conversation.id : null;
  closeUsage();
  // Another chat: its reply runs on at the gateway (reopened, the chat resumes it), but
  // stops streaming here, and the composer, Stop and Escape belong to this chat.
  // The same chat shown again keeps its reply: cleared unmarked, its loop's end later
  // cleared the reply of a chat opened meanwhile (Send shown while it streamed).
  const leaving = state.reply && state.reply.conversationId !== conversation?.id;
  if (leaving) {
    leaveReply(state.reply);
    state.reply = null;
  }
  state.conversation = conversation;
  $("chat-title").textContent = conversation ? conversation.title || "New chat" : "New chat";
  $("chat-model").textContent = conversation ? modelName(conversation.model) : "";
  $("rename").hidden = $("delete").hidden = !conversation;
  $("messages").replaceChildren();
  hideNotice();
  for (const message of visible(conversation)) $("messages").append(messageElement(message));
  // The same chat shown again: its streaming reply's bubble stays (dropped with the
  // list, the reply went on unseen).
  const streaming = !leaving && state.reply?.element && !state.reply.done;
  if (streaming) $("messages").append(state.reply.element);
  setBusy(!leaving && state.busy); // a message being sent to this chat keeps it busy
  markCurrent();
  scrollToEnd(true);
}

function modelName(model) {
  return state.modelNames.get(model) || model;
}

function visible(conversation) {
  return conversation ? conversation.messages.filter((m) => m.status !== "replaced") : [];
}

function messageElement(message) {
  const item = document.createElement("li");
  item.className = `message ${message.role}`;
  item.dataset.id = message.id || "";
  // A question the model was sent (one that failed is not: regenerate answers the one before).
  if (message.role === "user" && message.id && message.status !== "failed") item.dataset.sent = "";
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.textContent = message.role === "user" ? "You" : `Assistant${message.model ? ` · ${modelName(message.model)}` : ""}`;
  if (message.role === "user" && message.status === "failed") meta.append(" · not sent");
  else if (ENDINGS[endingOf(message)]) meta.append(ENDINGS[endingOf(message)].note);
  if (message.role === "user" && message.id && message.status !== "failed") {
    const edit = document.createElement("button");
    edit.type = "button";
    edit.className = "quiet edit";
    edit.hidden = state.busy; // an edit reruns from it: not while a reply runs
    edit.textContent = "Edit";
    edit.setAttribute("aria-label", "Edit this message and rerun from it");
    edit.addEventListener("click", () => startEdit(item, message));
    meta.append(edit);
  }
  const body = document.createElement("div");
  body.className = "body";
  setBody(body, message.role, message.content);
  if (!message.content) explainEmpty(body, message.status);
  if (message.role === "assistant") {
    meta.append(copyButton("quiet", "Copy this reply", () => sources.get(body) ?? ""));
  }
  meta.append(timeElement(message.created_at));
  item.append(meta, body);
  return item;
}

function timeElement(createdAt) {
  const at = createdAt ? new Date(createdAt) : new Date();
  const time = document.createElement("time");
  time.dateTime = at.toISOString();
  time.textContent = at.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  time.title = at.toLocaleString();
  return time;
}

// A reply that ended early is noted beside its author and, with no text, says why
// instead of showing an empty bubble. Keyed by the stored status.
const ENDINGS = {
  stopped: { note: " · stopped", empty: "Stopped before any text." },
  expired: { note: " · expired", empty: "No reply: the model was too busy to start it in time." },
  failed: { note: " · failed", empty: "No reply: it failed." },
  cut: { note: " · cut at the length limit" }, // else it looked finished, mid-sentence
};
// How a reply ended, live (its final event's finish_reason) or stored (its status).
const LIVE_ENDINGS = { cancelled: "stopped", expired: "expired", length: "cut" };

function endingOf(message) {
  return message.role === "assistant" && message.finish_reason === "length" ? "cut" : message.status;
}

function explainEmpty(body, status) {
  const reason = ENDINGS[status]?.empty;
  if (!reason) return;
  const note = document.createElement("p");
  note.className = "placeholder";
  note.textContent = reason;
  body.replaceChildren(note);
}

function setBody(body, role, text) {
  // The user's own text is shown as typed; the model's is rendered Markdown.
  if (role === "user") {
    body.innerHTML = escapeHtml(text).replace(/\n/g, "<br>");
    sources.set(body, text); // as sent: Edit starts from it, not from what is shown
    return;
  }
  body.innerHTML = renderMarkdown(text);
  sources.set(body, text);
  addCodeCopyButtons(body);
}

// ---- sending, streaming, resuming ---------------------------------------------------

function leaveReply(reply) {
  reply.left = true;
  reply.controller.abort();
}

// A message refused, or not sent: its text goes back to the composer, unless another
// was typed meanwhile.
function restoreDraft(text) {
  if (!$("prompt").value.trim()) $("prompt").value = text;
}

async function send(text) {
  // A chat clicked and still loading: the message is for it (it went to a new chat).
  // Not opened after all: the chat on screen stays open (its 404 closed it), and the
  // message waits in the composer.
  if (state.wanted && state.wanted !== state.conversation?.id) {
    const wanted = state.wanted;
    try {
      await openConversation(wanted, false);
    } catch (error) {
      restoreDraft(text);
      notOpened(wanted, error);
      return;
    }
  }
  let created = null;
  if (!state.conversation) {
    created = await state.api.json("POST", "/v1/conversations", { model: $("model-picker").value });
    showConversation({ ...created, messages: [] });
    // Listed meanwhile, not awaited: a chat clicked while the list loaded got the message.
    loadConversations(true).catch(() => {});
    $("chat-title").textContent = Array.from(text).slice(0, AUTO_TITLE_CHARS).join("");
  }
  const path = `/v1/conversations/${state.conversation.id}/messages`;
  const questionsBefore = $("messages").querySelectorAll(".message.user").length;
  const userMessage = messageElement({ role: "user", content: text });
  $("messages").append(userMessage);
  scrollToEnd(true);
  let refused = false;
  let taken = false;
  const reply = await streamReply(
    () => state.api.request("POST", path, { content: text }),
    (event) => {
      // Now it has an id: shown again, with its Edit button.
      if (!event.user_message_id) return;
      taken = true;
      userMessage.replaceWith(messageElement({ role: "user", id: event.user_message_id, content: text }));
    },
    (error, left) => {
      refused = true;
      if (taken || (!left && !userMessage.isConnected)) return; // started: sent, whatever came after
      userMessage.remove();
      restoreDraft(text);
      // Shown as it runs, with its Stop: the refusal alone left no way to stop it.
      if (!left && runsElsewhere(error)) openConversation(state.conversation.id, true, error).catch(notify);
    },
    (conversationId) => {
      // Sent without an answer, no reply ran, and the chat was reloaded as stored: one
      // question more than before if the gateway has it (not told by its text, which
      // is stored redacted and may be an earlier question's).
      if (state.conversation?.id !== conversationId) return;
      if ($("messages").querySelectorAll(".message.user").length > questionsBefore) return;
      restoreDraft(text);
      notify(new ApiError(0, "Your message was not sent: the gateway could not be reached."));
    },
  );
  // Neither answered nor found stored, the stream never answered either (the gateway
  // unreachable throughout): the text goes back to the composer, not lost; reopened
  // later, the chat shows it if it was taken.
  const unreached = !refused && !reply.begun && !reply.done && !reply.reloaded && !reply.left;
  if (unreached && userMessage.isConnected) {
    userMessage.remove();
    restoreDraft(text);
    notify(new ApiError(0, "Your message may not have been sent: the gateway could not be reached."));
  }
  // Only an answered first reply gets a title job (producers/gateway/chat/jobs.py).
  if (created && ANSWERED.has(reply.finishReason)) {
    const named = await state.api.json("GET", `/v1/conversations/${created.id}`).catch(() => null);
    if (named && state.conversation?.id === created.id) {
      setTitle(named.title);
      watchTitle(created.id, named.title);
    }
  }
}

// `started(event)` when the gateway took the message; `refused(error, left)` on an API
// error (`left`: the page had left the chat meanwhile).
// With `unanswered`, a message sent without an answer is not taken as refused: the
// stream is asked, and `unanswered(conversationId)` is told when no reply ran and the
// chat was reloaded as stored.
async function streamReply(open, started = () => {}, refused = () => {}, unanswered = null) {
  hideNotice();
  setBusy(true);
  const reply = newReply(started);
  reply.stopAsked = state.stopAsked;
  state.stopAsked = false;
  state.reply = reply;
  try {
    const response = await (unanswered ? sent(open) : open());
    if (response) await follow(reply, response);
    await resumeUntilDone(reply);
    if (!response && !reply.begun && !reply.left && reply.reloaded) {
      unanswered(reply.conversationId);
    }
  } catch (error) {
    if (reply.left) {
      // Refused once the page had left the chat: its text given back and the refusal
      // said, not lost without a word (the chat shown hears none of its events).
      if (error instanceof ApiError && !reply.begun && !noAnswer(error)) {
        refused(error, true);
        // Status 0: the page's own words, shown whole (explained again, twice prefixed).
        notify(error.status === 401 ? error : new ApiError(0, `Not sent to the chat you left: ${explain(error)}`));
      }
      return reply;
    }
    if (error instanceof ApiError) refused(error, false);
    endUnfinished(reply); // else it kept blinking, half written
    notify(error);
  } finally {
    if (!reply.left) {
      state.reply = null;
      setBusy(false);
    }
    loadConversations(true).catch(() => {});
  }
  return reply;
}

// No answer (the connection dropped, or a proxy's 502 or 504): the gateway may have
// taken the message all the same, and its reply runs. Null then, and the stream is asked:
// taken as refused, the question was taken off and its text put back while the reply
// ran out of sight, and sent again it was stored twice.
async function sent(open) {
  try {
    return await open();
  } catch (error) {
    if (noAnswer(error)) return null;
    throw error;
  }
}

function noAnswer(error) {
  return error instanceof ApiError && [0, 502, 504].includes(error.status);
}

function newReply(started = () => {}) {
  return {
    conversationId: state.conversation.id,
    controller: new AbortController(), // aborted when the page leaves its chat
    left: false,
    started,
    element: null,
    text: "",
    drawing: 0, // the frame its text is drawn in, once asked for
    attempt: 0,
    lastEventId: null,
    done: false,
    begun: false, // the gateway has it (its start event): a stop can reach it
    reloaded: false, // no reply ran, and the chat was shown as stored
    stopAsked: false,
    retryAfter: 0, // seconds the last refused resume asked the page to wait
  };
}

// A chat opened while its reply runs: followed as a sent message's reply is, with the
// same tries (it was tried once: a dropped connection or a proxy's 502 left no reply,
// and a Stop that answered 404).
async function resumeReply() {
  const reply = newReply();
  reply.begun = true; // it runs at the gateway already
  state.reply = reply;
  setBusy(true);
  try {
    await resumeFrom(reply);
    await resumeUntilDone(reply);
  } catch (error) {
    if (!reply.left) {
      endUnfinished(reply);
      notify(error);
    }
  } finally {
    if (!reply.left) {
      state.reply = null;
      setBusy(false);
    }
  }
}

// The connection dropped: resume where it stopped, with every try again after a resume
// that brought events (a long reply may drop more than RESUME_TRIES times). A refused
// resume's Retry-After is waited out: the page's own pause may be shorter.
async function resumeUntilDone(reply) {
  for (let tries = 0; !reply.done && !reply.left && tries < RESUME_TRIES; tries++) {
    const seen = reply.lastEventId;
    await sleep(Math.max(500 * 2 ** tries, 1000 * reply.retryAfter));
    reply.retryAfter = 0;
    await resumeFrom(reply);
    if (reply.lastEventId !== seen) tries = -1;
  }
  if (!reply.done && !reply.left) {
    endUnfinished(reply);
    notify(new Error("the connection dropped; reopen the chat to see the reply"));
  }
}

async function resumeFrom(reply) {
  const headers = reply.lastEventId ? { "Last-Event-ID": reply.lastEventId } : {};
  const path = `/v1/conversations/${reply.conversationId}/stream`;
  try {
    const signal = reply.controller.signal;
    await follow(reply, await state.api.request("GET", path, undefined, headers, signal));
  } catch (error) {
    if (reply.left) return;
    if (error instanceof ApiError && error.status === 404) {
      reply.done = true; // it finished meanwhile, or never started
      $("stop").hidden = true; // nothing runs to stop while its stored reply is looked for
      // The reply is over: a reload that fails is said, not taken as the message refused.
      reply.reloaded = await showWhenStored(reply.conversationId).then(
        () => true,
        (reloading) => {
          notify(reloading);
          return false;
        },
      );
      return;
    }
    // Dropped (0), too many resumes open (429: old ones not yet seen closed), a replica
    // draining (503) or a proxy's 502 or 504 in a rolling restart: the caller's loop
    // tries again after a pause.
    const passing = [0, 429].includes(error.status) || error.status >= 500;
    if (error instanceof ApiError && !passing) throw error;
    reply.retryAfter = Math.min(error.retryAfter || 0, 30); // a proxy's hour is not waited
  }
}

async function follow(reply, response) {
  try {
    for await (const { id, data } of readEvents(response, reply.controller.signal)) {
      if (reply.left) return;
      if (id) reply.lastEventId = id;
      if (data === "[DONE]") {
        reply.done = true;
        return;
      }
      handle(reply, data);
    }
  } catch (error) {
    if (error instanceof SyntaxError) throw error;
    // a network error mid-stream: the caller resumes
  }
}

function handle(reply, event) {
  if (event.type === "start") {
    reply.started(event);
    ensureReplyElement(reply, event.model);
    reply.begun = true;
    if (reply.stopAsked) {
      reply.stopAsked = false; // once: a resumed stream starts again too
      stop().catch(notify);
    }
  } else if (event.type === "restart") {
    reply.text = ""; // a worker restarted the reply: drop the partial text
    reply.attempt = event.attempt;
    const element = ensureReplyElement(reply);
    setBody(element.querySelector(".body"), "assistant", ""); // not left showing till its next token
    addMetaNote(element, " · restarted");
  } else if (event.type === "token") {
    reply.text += event.delta;
    ensureReplyElement(reply);
    drawSoon(reply);
  } else if (event.type === "final") {
    if (reply.finishReason) return; // again, in a resumed stream: noted once
    const element = ensureReplyElement(reply, event.model);
    drawNow(reply); // read out, and noted, as it ends
    markStreaming(element, false);
    reply.finishReason = event.finish_reason;
    const ending = LIVE_ENDINGS[event.finish_reason] ?? (event.error ? "failed" : "");
    if (ending) addMetaNote(element, ENDINGS[ending].note);
    if (!reply.text) explainEmpty(element.querySelector(".body"), ending);
    announce(element, ending);
    if (event.error) notify(new Error(event.error));
    scrollToEnd();
  } else if (event.type === "error") {
    endUnfinished(reply);
    notify(new Error(event.error));
  }
}

// Drawn once a frame, however many tokens came in it: a resumed reply replays its whole
// text at once, and each token rendered all of it again (seconds for a long reply), and
// lost a selection in it.
function drawSoon(reply) {
  if (!reply.drawing) reply.drawing = requestAnimationFrame(() => drawNow(reply));
}

function drawNow(reply) {
  if (reply.drawing) cancelAnimationFrame(reply.drawing);
  reply.drawing = 0;
  if (!reply.element) return;
  setBody(reply.element.querySelector(".body"), "assistant", reply.text);
  scrollToEnd();
}

// Beside the author's name, ahead of the buttons and the time, as a stored one shows it.
function addMetaNote(element, note) {
  const meta = element.querySelector(".meta");
  meta.insertBefore(document.createTextNode(note), meta.querySelector("button, time"));
}

// A reply that ended without its final (an error event, or resuming gave up): no
// cursor left blinking, and no empty bubble.
function endUnfinished(reply) {
  if (!reply.element) return;
  drawNow(reply);
  markStreaming(reply.element, false);
  if (!reply.text) explainEmpty(reply.element.querySelector(".body"), "failed");
}

// A reply is read out once, when it is over, from a live region of its own: the list
// was one, and a screen reader read the whole chat each time one was opened (and each
// token's new nodes read the reply again).
function announce(element, ending) {
  const text = element.querySelector(".body").textContent;
  $("announcer").textContent = ending ? `${text} (${ending})` : text;
}

function markStreaming(element, streaming) {
  element.classList.toggle("streaming", streaming);
  if (streaming) element.setAttribute("aria-busy", "true");
  else element.removeAttribute("aria-busy");
}

function ensureReplyElement(reply, model) {
  if (!reply.element) {
    reply.element = messageElement({ role: "assistant", content: "", model });
    markStreaming(reply.element, true);
    $("messages").append(reply.element);
  }
  return reply.element;
}

// ---- stop, regenerate, edit, rename, delete -------------------------------------------

// A Stop pressed before the gateway has the reply (it answers 409 until then, and a
// new chat has no id yet) is sent once the reply starts: the reply ran to its end.
async function stop() {
  const reply = state.reply;
  if (reply?.done) return; // over (Escape while its stored reply is looked for)
  if (reply && !reply.begun) {
    reply.stopAsked = true;
    return;
  }
  if (!reply && !state.conversation) {
    state.stopAsked = true; // the chat is being created
    return;
  }
  const id = reply?.conversationId ?? state.conversation.id;
  try {
    await state.api.json("POST", `/v1/conversations/${id}/stop`);
  } catch (error) {
    // Pressed as the reply ended (or twice): its end is on its way here. Still running
    // a while later, the gateway lost track of it, and the reader is told.
    const ended = error instanceof ApiError && error.status === 409 && reply && (await endsWithin(reply, STOP_GRACE_MS));
    if (!ended) throw error;
  }
}

async function endsWithin(reply, ms) {
  for (let waited = 0; !reply.finishReason && !reply.left && state.reply === reply; waited += 100) {
    if (waited >= ms) return false;
    await sleep(100);
  }
  return true;
}

async function regenerate() {
  const id = state.conversation.id;
  const path = `/v1/conversations/${id}/regenerate`;
  // The question the reply shown answers: a tab behind another (a newer question sent
  // there) is refused, and shown the chat as it is, rather than answer the newer one.
  const questions = $("messages").querySelectorAll(".message.user[data-sent]");
  const question = questions[questions.length - 1];
  const replyTo = question?.dataset.id;
  const replacedBefore = repliesReplaced(replyTo);
  const hadReply = Boolean(question?.nextElementSibling); // else: a question never answered
  await streamReply(
    () => {
      // Replaced, as the gateway replaces them: what follows the question it answers
      // (not the last reply shown, which may answer an earlier one). First: unanswered,
      // the new reply may stream (a refusal, or none running, shows the chat as stored).
      while (question?.nextElementSibling) question.nextElementSibling.remove();
      return state.api.request("POST", path, replyTo ? { reply_to: replyTo } : {});
    },
    () => {},
    // Reopened, then told why (showing a chat hides the notice).
    async (error) => {
      if (state.wanted !== id) return;
      await openConversation(id, runsElsewhere(error), error).catch(notify);
    },
    // Unanswered, and the chat as stored replaced no reply: said, or the reply shown
    // before came back from the store as if the model had written it again.
    () => {
      if (state.wanted === id && hadReply && repliesReplaced(replyTo) === replacedBefore) {
        notify(new ApiError(0, "Your regenerate was not sent: the gateway could not be reached."));
      }
    },
  );
}

// How many replies to the question a regenerate replaced, as the chat was last read
// (none where it was read before the question: a chat begun on this page).
function repliesReplaced(questionId) {
  const messages = state.conversation?.messages ?? [];
  const at = messages.findIndex((m) => m.id === questionId);
  return at < 0 ? 0 : messages.slice(at + 1).filter((m) => m.status === "replaced").length;
}

// `draft`: the text to start from (an edit refused: what was typed, not lost).
function startEdit(item, message, draft = null) {
  const open = item.querySelector("textarea");
  if (open) return open.focus(); // one editor: a second one's Save reran from stale text
  const body = item.querySelector(".body");
  const editor = document.createElement("textarea");
  editor.value = draft ?? sources.get(body) ?? body.innerText;
  editor.setAttribute("aria-label", "Edited message");
  const save = document.createElement("button");
  save.type = "button";
  save.textContent = "Save and rerun";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  const restore = () => {
    editor.remove(); save.remove(); cancel.remove();
    body.hidden = false;
  };
  cancel.addEventListener("click", restore);
  save.addEventListener("click", async () => {
    const text = editor.value.trim();
    if (!text || state.busy) return;
    const id = item.dataset.id || message.id;
    const conversationId = state.conversation.id;
    const path = `/v1/conversations/${conversationId}/messages/${id}/edit`;
    restore();
    const shown = () =>
      item.isConnected ? item : $("messages").querySelector(`.message.user[data-id="${CSS.escape(id)}"]`);
    const reply = await streamReply(
      async () => {
        let response;
        try {
          response = await state.api.request("POST", path, { content: text });
        } catch (error) {
          // Unanswered, the edit may have been taken: the chat as stored shows it, and
          // its reply streams below (taken as refused, the reply ran out of sight).
          if (noAnswer(error)) await openConversation(conversationId, false).catch(() => {});
          throw error;
        }
        while (item.nextSibling) item.nextSibling.remove();
        setBody(body, "user", text);
        return response;
      },
      // The edit is stored as a new message: a second edit names that one.
      (event) => event.user_message_id && (item.dataset.id = event.user_message_id),
      (error, left) => {
        if (left) return restoreDraft(text);
        startEdit(item, message, text);
        // Another tab's reply runs here: shown, with its Stop (the refusal alone left no
        // way to stop it), and the edit's text kept in its editor for once it ends.
        const again = () => {
          const kept = $("messages").querySelector(`.message.user[data-id="${CSS.escape(id)}"]`);
          if (kept) startEdit(kept, { ...message, id }, text);
        };
        if (runsElsewhere(error)) openConversation(conversationId, true, error, again).catch(notify);
      },
      () => {
        // No reply ran; the message edited still shown (not replaced): not taken.
        const kept = shown();
        if (state.conversation?.id !== conversationId || !kept) return;
        startEdit(kept, { ...message, id }, text);
        notify(new ApiError(0, "Your edit was not sent: the gateway could not be reached."));
      },
    );
    // Neither answered nor found stored (the gateway unreachable throughout): the text
    // goes back to its editor, not lost (an editor already open is only focused).
    const kept = shown();
    if (!reply.begun && !reply.reloaded && !reply.left && kept) startEdit(kept, { ...message, id }, text);
  });
  editor.addEventListener("keydown", (e) => {
    if (e.key !== "Escape" || composing(e)) return; // that Escape is the input method's
    e.stopPropagation(); // closes the editor; it does not stop the reply too
    restore();
  });
  body.hidden = true;
  item.append(editor, save, cancel);
  editor.focus();
}

async function rename() {
  const title = prompt("Rename this chat", state.conversation.title || "");
  if (!title || !title.trim()) return;
  const updated = await state.api.json("PATCH", `/v1/conversations/${state.conversation.id}`, {
    title: title.trim(),
  });
  setTitle(updated.title);
  await loadConversations(true);
}

async function remove() {
  if (!confirm("Delete this chat? This cannot be undone.")) return;
  const id = state.conversation.id;
  await state.api.json("DELETE", `/v1/conversations/${id}`);
  // Another chat opened while the delete ran (it stops the chat's reply first) stays.
  if (state.conversation?.id === id || state.wanted === id) {
    showConversation(null);
    $("prompt").focus(); // Delete hid as it was pressed: the focus fell to the page's top
  }
  await loadConversations(true);
}

// ---- helpers ---------------------------------------------------------------------

function setBusy(busy) {
  state.busy = busy;
  const focused = document.activeElement;
  $("send").hidden = busy;
  // A reply that ended, its stored copy looked for: nothing to stop (a Stop showed
  // again as the chat was reloaded, and did nothing).
  $("stop").hidden = !busy || Boolean(state.reply?.done);
  // The button pressed from the keyboard hides: its twin, or the composer, takes the
  // focus (it fell to the page's top, the next Tab starting from the sidebar).
  if ((focused === $("send") || focused === $("regenerate")) && busy) $("stop").focus();
  if (focused === $("stop") && !busy) $("prompt").focus();
  // A reply to regenerate, or a question sent and never answered: regenerate answers it.
  const answerable = $("messages").querySelector(".message.assistant, .message.user[data-sent]") !== null;
  $("regenerate").hidden = busy || !answerable;
  for (const edit of $("messages").querySelectorAll("button.edit")) edit.hidden = busy;
}

function notify(error) {
  if (error instanceof ApiError && error.status === 401) signOut();
  // Deleted in another tab: it stayed open, and every message sent to it failed so.
  if (isGone(error)) {
    showConversation(null); // before the notice: a chat shown hides it
    loadConversations(true).catch(() => {});
  }
  say(error);
}

function isGone(error) {
  return error instanceof ApiError && error.status === 404 && error.message === "conversation not found";
}

function say(error) {
  $("notice").textContent = explain(error);
  $("notice").hidden = false;
}

function hideNotice() {
  $("notice").hidden = true;
}

// New text keeps the list at its end only if the reader was there: scrolled up to read,
// they stay put and the "latest" button offers the way back.
function scrollToEnd(force = false) {
  const list = $("messages");
  if (force) state.following = true;
  // Scrolled up since the page last pinned the list, its scroll event not handled yet:
  // new text must not pull the reader back down. (Not a list that shrank under a
  // re-render: the browser keeps that one at its end.)
  else if (list.scrollTop < state.pinnedAt - NEAR_BOTTOM_PX && !nearEnd(list)) {
    state.following = false;
  }
  if (state.following) {
    list.scrollTop = list.scrollHeight;
    state.pinnedAt = list.scrollTop;
  }
  $("to-latest").hidden = state.following || list.scrollHeight <= list.clientHeight;
}

function onScroll() {
  state.following = nearEnd($("messages"));
  $("to-latest").hidden = state.following;
}

function nearEnd(list) {
  return list.scrollHeight - list.scrollTop - list.clientHeight < NEAR_BOTTOM_PX;
}

// ---- the usage view -------------------------------------------------------------------

async function openUsage() {
  $("chat").hidden = true;
  $("usage").hidden = false;
  clearInterval(state.usageTimer);
  state.usageTimer = setInterval(refreshUsage, USAGE_REFRESH_MS);
  await refreshUsage();
}

// Its errors show in the view itself (the chat's notice is hidden behind it).
async function refreshUsage() {
  try {
    renderUsage(await state.api.json("GET", "/v1/usage"));
    $("usage-notice").hidden = true;
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) signOut();
    $("usage-notice").textContent = `${explain(error)} The figures shown may be out of date.`;
    $("usage-notice").hidden = false;
  }
}

function closeUsage() {
  if ($("usage").hidden) return;
  clearInterval(state.usageTimer);
  state.usageTimer = null;
  $("usage").hidden = true;
  $("usage-notice").hidden = true;
  $("chat").hidden = false;
  scrollToEnd(true); // hidden, the list lost its place
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// A sign-in that failed once the app showed (its chats' list refused): the form again,
// with why. Written into the hidden form, the error showed nowhere, the chats empty.
function showSignInError(error) {
  $("app").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = explain(error);
}

// ---- wiring --------------------------------------------------------------------------

function wire() {
  $("signin-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    $("signin-error").textContent = "";
    try {
      await signIn($("api-key").value.trim());
    } catch (error) {
      showSignInError(error);
    }
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.busy) return;
    $("prompt").value = "";
    setBusy(true); // at once: a second Enter must not send twice
    send(text)
      .catch((error) => {
        restoreDraft(text); // the chat could not be created: nothing was sent
        notify(error);
      })
      .finally(() => {
        state.stopAsked = false; // for this message: not the next one's
        setBusy(Boolean(state.reply));
      });
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !composing(e)) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    // On the usage view Escape closes it: it stopped a reply the user could not see.
    if (e.key === "Escape" && !$("usage").hidden) return closeUsage();
    // Busy without a reply: its new chat is being created (stop() remembers it).
    if (e.key === "Escape" && (state.reply || state.busy) && !composing(e)) {
      stop().catch(notify);
    }
  });
  $("stop").addEventListener("click", () => stop().catch(notify));
  $("regenerate").addEventListener("click", () => regenerate().catch(notify));
  $("new-chat").addEventListener("click", () => {
    showConversation(null);
    $("prompt").focus();
  });
  $("more-conversations").addEventListener("click", () => loadMore().catch(notify));
  $("rename").addEventListener("click", () => rename().catch(notify));
  $("delete").addEventListener("click", () => remove().catch(notify));
  $("sign-out").addEventListener("click", signOut);
  $("show-usage").addEventListener("click", openUsage);
  $("close-usage").addEventListener("click", closeUsage);
  $("messages").addEventListener("scroll", onScroll);
  $("to-latest").addEventListener("click", () => scrollToEnd(true));
}

wire();
const saved = sessionStorage.getItem(KEY_STORAGE);
if (saved) {
  signIn(saved).catch((error) => {
    // Only a key refused is forgotten: a gateway restarting (503) or a dropped
    // connection signed the user out, the key gone with it.
    if (error instanceof ApiError && error.status === 401) return signOut();
    $("api-key").value = saved;
    showSignInError(error);
  });
} else {
  $("signin").hidden = false;
  $("api-key").focus();
}
