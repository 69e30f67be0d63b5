// Copy buttons: one on each code block of a rendered reply, one on a whole reply (its
// Markdown source, as the model wrote it).

export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  // Served over plain HTTP from another host the Clipboard API is off: the old way.
  const area = document.createElement("textarea");
  area.value = text;
  document.body.append(area);
  area.select();
  const copied = document.execCommand("copy");
  area.remove();
  if (!copied) throw new Error("the browser refused to copy");
}

export function copyButton(className, ariaLabel, text) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = className;
  button.textContent = "Copy";
  button.setAttribute("aria-label", ariaLabel);
  button.addEventListener("click", async () => {
    try {
      await copyText(text());
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => (button.textContent = "Copy"), 1500);
  });
  return button;
}

export function addCodeCopyButtons(body) {
  for (const pre of body.querySelectorAll("pre")) {
    const block = document.createElement("div");
    block.className = "code";
    pre.replaceWith(block);
    block.append(pre, copyButton("copy", "Copy this code", () => pre.textContent));
  }
}
