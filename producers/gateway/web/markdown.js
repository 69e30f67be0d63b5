// A small Markdown renderer for replies. Everything is HTML-escaped first, so model
// output can never inject markup; only the constructs below become elements.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// An address may hold one level of parentheses (".../wiki/Foo_(bar)"). Neither part runs
// past a bracket: from every "[" of a line of them, an earlier pattern scanned to the
// line's end (quadratic: 16,000 "[" took 227 ms a render, and a reply re-renders at
// each token, freezing the page for most of a minute).
const LINK = /\[([^[\]\n]+)\]\((https?:\/\/(?:[^\s()[\]]|\([^\s()[\]]*\))+)\)/g;
// Where a link's tags go once emphasis is marked: marks of their own, so that a link's
// close, digits and the next link's open ("[a](..)2[b](..)") never read as an open.
const OPENS = /\u0001(\d+)\u0002/g;
const CLOSES = /\u0003/g;

function inline(text) {
  // `text` is already escaped; code spans are cut out first so nothing inside them changes.
  return text
    .split(/(`[^`\n]+`)/g)
    .map((part) => {
      if (/^`[^`\n]+`$/.test(part)) return `<code>${part.slice(1, -1)}</code>`;
      // Links are held out while emphasis is marked: a "*" in an address put <em> inside
      // its href, which then led elsewhere.
      const hrefs = [];
      const held = part.replace(/[\u0001-\u0003]/g, "\ufffd").replace(LINK, (_, label, href) => {
        hrefs.push(href);
        return `\u0001${hrefs.length - 1}\u0002${label}\u0003`;
      });
      const opening = (_, n) =>
        `<a href="${hrefs[n]}" rel="noopener noreferrer nofollow" target="_blank">`;
      return emphasis(held).replace(OPENS, opening).replace(CLOSES, "</a>");
    })
    .join("");
}

function emphasis(text) {
  return text
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>");
}

function flushParagraph(lines, out) {
  if (lines.length) out.push(`<p>${lines.map(inline).join("<br>")}</p>`);
  lines.length = 0;
}

// An ordered list goes on from its first item's number: a model's "1. ...", a blank
// line, "2. ..." showed "1." at each step.
function flushList(items, ordered, out) {
  if (!items.length) return;
  const tag = ordered ? "ol" : "ul";
  const start = ordered && items.start !== 1 ? ` start="${items.start}"` : "";
  out.push(`<${tag}${start}>${items.map((i) => `<li>${inline(i)}</li>`).join("")}</${tag}>`);
  items.length = 0;
}

export function renderMarkdown(source) {
  const out = [];
  const paragraph = [];
  const items = [];
  let ordered = false;
  let code = null; // lines of an open fenced block (it may still be streaming)
  let language = "";
  // Windows line ends too: a "\r" left at a line's end kept it from being a heading.
  for (const line of escapeHtml(source).split(/\r\n?|\n/)) {
    // Trimmed first: with a space class on both sides of the language, a line of
    // spaces after "```" took quadratic time (30,000 spaces, 0.7 s a render).
    const fence = line.trim().match(/^```\s*([\w+-]*)$/);
    if (code !== null) {
      if (fence) {
        out.push(codeBlock(code, language));
        code = null;
      } else {
        code.push(line);
      }
      continue;
    }
    if (fence) {
      flushParagraph(paragraph, out);
      flushList(items, ordered, out);
      code = [];
      language = fence[1];
      continue;
    }
    const heading = line.match(/^(#{1,4})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*(\d{1,9})[.)]\s+(.*)$/);
    if (heading) {
      flushParagraph(paragraph, out);
      flushList(items, ordered, out);
      const level = heading[1].length + 2; // h3..h6 inside a message
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
    } else if (bullet || numbered) {
      flushParagraph(paragraph, out);
      if (items.length && ordered !== Boolean(numbered)) flushList(items, ordered, out);
      ordered = Boolean(numbered);
      if (!items.length) items.start = numbered ? Number(numbered[1]) : 1;
      items.push(bullet ? bullet[1] : numbered[2]);
    } else if (line.trim() === "") {
      flushParagraph(paragraph, out);
      flushList(items, ordered, out);
    } else {
      flushList(items, ordered, out);
      paragraph.push(line);
    }
  }
  flushParagraph(paragraph, out);
  flushList(items, ordered, out);
  if (code !== null) out.push(codeBlock(code, language));
  return out.join("");
}

function codeBlock(lines, language) {
  const cls = language ? ` class="language-${language}"` : "";
  return `<pre><code${cls}>${lines.join("\n")}</code></pre>`;
}
