// "Your usage": the signed-in user's requests and tokens (today, the last 7 days, a bar
// per day) and the tier's per-minute limits with what is used of each now, from
// GET /v1/usage. Built with DOM calls only: the page's CSP allows no inline styles.

const SVG = "http://www.w3.org/2000/svg";
const CHART = { width: 700, height: 160, bar: 64, labels: 18 };
const LIMITS = [
  ["requests_per_minute", "Requests per minute"],
  ["tokens_per_minute", "Tokens per minute"],
  ["concurrent_streams", "Replies streaming at once"],
];
const $ = (id) => document.getElementById(id);
const number = (n) => n.toLocaleString("en-US");

export function renderUsage(usage) {
  $("usage-tier").textContent = `Tier: ${usage.tier}. Days are UTC days.`;
  $("usage-today-requests").textContent = number(usage.today.requests);
  $("usage-today-tokens").textContent = number(usage.today.total_tokens);
  $("usage-week-requests").textContent = number(usage.last_7_days.requests);
  $("usage-week-tokens").textContent = number(usage.last_7_days.total_tokens);
  renderChart($("usage-chart"), usage.days);
  $("usage-limits").replaceChildren(
    ...LIMITS.map(([key, label]) => limitRow(label, usage.limits[key])),
  );
}

function renderChart(svg, days) {
  svg.setAttribute("viewBox", `0 0 ${CHART.width} ${CHART.height}`);
  const most = Math.max(1, ...days.map((d) => d.total_tokens));
  const room = CHART.height - 2 * CHART.labels;
  const step = CHART.width / days.length;
  svg.replaceChildren(
    ...days.flatMap((day, i) => {
      const height = Math.round((day.total_tokens / most) * room);
      const x = i * step + (step - CHART.bar) / 2;
      const bar = element("rect", {
        x, y: CHART.labels + room - height, width: CHART.bar, height,
        "data-day": day.day, "data-tokens": day.total_tokens,
      });
      const tip = element("title", {});
      tip.textContent = `${day.day}: ${number(day.total_tokens)} tokens, ${number(day.requests)} requests`;
      bar.append(tip);
      return [
        bar,
        label(x + CHART.bar / 2, CHART.labels + room - height - 4, number(day.total_tokens)),
        label(x + CHART.bar / 2, CHART.height - 4, day.day.slice(5)),
      ];
    }),
  );
}

function label(x, y, text) {
  const node = element("text", { x, y, "text-anchor": "middle" });
  node.textContent = text;
  return node;
}

function element(name, attributes) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  return node;
}

function limitRow(label, { limit, used }) {
  const row = document.createElement("tr");
  const meter = document.createElement("meter");
  meter.min = 0;
  meter.max = limit;
  meter.value = used ?? 0;
  meter.high = limit * 0.8;
  const cells = [label, used === null ? "unknown right now" : number(used), number(limit)];
  row.append(...cells.map(cell), cell(meter));
  row.dataset.limit = label;
  return row;
}

function cell(content) {
  const td = document.createElement("td");
  td.append(content);
  return td;
}
