// tpugen's page: plain JavaScript, no library. Every data call goes to the server's own JSON endpoints with the
// API key (kept in sessionStorage for this tab); the page's own files are the only thing served without it.
"use strict";

const KEY_STORE = "tpugen-api-key";
const PAGE_SIZE = 24; // a run's thumbnails per gallery page
const STATUS_EVERY_MS = 3000;
const PROGRESS_EVERY_MS = 400;
const BUSY_RETRIES = 20; // a 503 is retried this many times, each after its Retry-After
// Sizes a person may ask for beyond the warm ones: shown as cold (compiled on first use, or refused).
const COMMON_SIZES = [[512, 512], [768, 768], [1024, 1024], [1024, 768], [768, 1024]];
// The field a server's error line names, by how the line starts (the A1111 fields and tpugen's own words).
const FIELD_OF_LINE = [
  [/^negative[_ ]prompt\b/i, "negative_prompt"],
  [/^prompt\b/i, "prompt"],
  [/^(size|width|height)\b/i, "size"],
  [/^(\d+ )?steps\b/i, "steps"],
  [/^(guidance|cfg_scale|cfg\b)/i, "guidance"],
  [/^seed\b/i, "seed"],
  [/^(sampler|sampler_name|scheduler)\b/i, "sampler"],
  [/^(batch_size|n_iter|\d+ images asked|the request asks for no images)/i, "count"],
];

const $ = (id) => document.getElementById(id);
let server = null; // GET /v1/server's answer
let keyWaiters = null; // callers waiting for the person to type the key

// ---------------------------------------------------------------- talking to the server

function apiKey() {
  return sessionStorage.getItem(KEY_STORE);
}

function askForKey(message) {
  if (!keyWaiters) {
    keyWaiters = [];
    $("key-form").hidden = false;
    $("key-error").textContent = message || "";
    $("key").focus();
  }
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const value = $("key").value.trim();
  if (!value) return;
  sessionStorage.setItem(KEY_STORE, value);
  $("key-form").hidden = true;
  $("key").value = "";
  const waiting = keyWaiters || [];
  keyWaiters = null;
  waiting.forEach((resolve) => resolve());
});

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function retryAfter(response) {
  const seconds = parseInt(response.headers.get("Retry-After") || "", 10);
  return Number.isFinite(seconds) && seconds >= 0 ? Math.min(seconds, 300) : 5;
}

async function linesOf(response) {
  try {
    const body = await response.json();
    if (Array.isArray(body.detail)) return body.detail.map(String);
    if (body.error && body.error.message) return [String(body.error.message)];
  } catch (error) {
    // not JSON: the status line is all there is
  }
  return [`${response.status} ${response.statusText}`];
}

async function showBusy(seconds, lines) {
  const busy = $("busy");
  busy.hidden = false;
  for (let left = seconds; left > 0; left--) {
    busy.textContent = `busy, retrying in ${left} s` + (lines.length ? ` (${lines.join("; ")})` : "");
    await sleep(1000);
  }
  busy.textContent = "busy, retrying now";
}

// fetch with the key: a 401 asks the person for the key and tries again, a 503 waits as Retry-After says and
// tries again (BUSY_RETRIES times, unless `busyRetries` is false). Answers the last Response.
async function call(path, { method = "GET", body, busyRetries = true, signal } = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = {};
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (response.status === 401) {
      const lines = await linesOf(response);
      sessionStorage.removeItem(KEY_STORE);
      await askForKey(key ? "that key was refused: " + lines.join("; ") : "");
      continue;
    }
    if (response.status === 503 && busyRetries && attempt < BUSY_RETRIES) {
      await showBusy(retryAfter(response), await linesOf(response));
      continue;
    }
    $("busy").hidden = true;
    return response;
  }
}

async function callJSON(path, options) {
  const response = await call(path, options);
  if (!response.ok) throw new ServerError(response.status, await linesOf(response));
  return response.json();
}

class ServerError extends Error {
  constructor(status, lines) {
    super(lines.join("; "));
    this.status = status;
    this.lines = lines;
  }
}

// An image file of a run as a URL an <img> can show: the file's own URL without a key; with one, a blob: URL
// of it fetched with the key (an <img> cannot send a header).
const blobUrls = [];
async function fileUrl(path) {
  if (!apiKey()) return path;
  const response = await call(path, { busyRetries: false });
  if (!response.ok) throw new ServerError(response.status, await linesOf(response));
  const url = URL.createObjectURL(await response.blob());
  blobUrls.push(url);
  return url;
}

function forgetBlobs() {
  blobUrls.splice(0).forEach((url) => URL.revokeObjectURL(url));
}

// Server-sent events read with fetch (EventSource cannot send the key): calls onEvent(name, data) per event.
async function readEvents(path, onEvent, signal) {
  const response = await call(path, { busyRetries: false, signal });
  if (!response.ok || !response.body) throw new ServerError(response.status, await linesOf(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    text += decoder.decode(value, { stream: true });
    let end;
    while ((end = text.indexOf("\n\n")) >= 0) {
      const frame = text.slice(0, end);
      text = text.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

// ---------------------------------------------------------------- small DOM helpers

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "text") node.textContent = value;
    else if (name === "className") node.className = value;
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
  }
  children.forEach((child) => node.append(child));
  return node;
}

function fixed(value, digits = 2) {
  return typeof value === "number" ? value.toFixed(digits) : value === null || value === undefined ? "n/a" : String(value);
}

function copyText(text, button) {
  const done = () => {
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = label), 1200);
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => copyBySelection(text) && done());
  } else if (copyBySelection(text)) {
    done();
  }
}

function copyBySelection(text) {
  // Over plain http (a TPU VM's address) the clipboard API is off; a selected textarea still copies.
  const area = element("textarea", { readonly: "" });
  area.value = text;
  document.body.append(area);
  area.select();
  const copied = document.execCommand("copy");
  area.remove();
  return copied;
}

// ---------------------------------------------------------------- status

async function refreshStatus() {
  const state = $("status-state");
  try {
    const ready = await (await fetch("/readyz")).json();
    state.textContent = ready.status;
    state.className = `state ${ready.status}`;
    $("status-detail").textContent = ready.detail || ready.error || "";
  } catch (error) {
    state.textContent = "unreachable";
    state.className = "state unreachable";
    $("status-detail").textContent = "";
    return;
  }
  if (keyWaiters) return; // the person has not given the key yet
  try {
    const response = await call("/v1/server", { busyRetries: false });
    if (!response.ok) return; // loading or draining: /readyz above says so
    server = await response.json();
    showServer(server);
  } catch (error) {
    // the next round tries again
  }
}

function showServer(info) {
  $("status-queue").textContent =
    `${info.queue_depth} images waiting, ${info.requests_open} requests open, ${info.runs_open} runs`;
  $("status-model").textContent = `${info.model.label} (${info.model.family})`;
  const device = info.device || {};
  $("status-device").textContent =
    `${device.backend || "?"} on ${device.device_kind || "?"}` + (info.engines > 1 ? `, ${info.engines} engines` : "");
  $("status-warm").textContent = info.warm.summary;
}

// ---------------------------------------------------------------- make

function fillForm(info) {
  const size = $("size");
  size.replaceChildren();
  const warm = info.warm.sizes.map((s) => [s.width, s.height]);
  const cold = info.new_shapes === "compile" ? "cold: compiles on first use" : "not warm: refused";
  for (const [width, height] of warm) {
    size.append(element("option", { value: `${width}x${height}`, text: `${width} x ${height}` }));
  }
  for (const [width, height] of COMMON_SIZES) {
    if (warm.some(([w, h]) => w === width && h === height)) continue;
    size.append(element("option", {
      value: `${width}x${height}`, text: `${width} x ${height} (${cold})`,
      disabled: info.new_shapes === "reject" ? "" : null, "data-cold": "",
    }));
  }
  size.value = `${info.defaults.width}x${info.defaults.height}`;

  const sampler = $("sampler");
  sampler.replaceChildren();
  for (const choice of info.samplers) {
    const notes = [choice.default ? "the model's own" : "", choice.warm ? "" : cold].filter(Boolean).join(", ");
    sampler.append(element("option", {
      value: choice.name, text: choice.name + (notes ? ` (${notes})` : ""),
      disabled: !choice.warm && info.new_shapes === "reject" ? "" : null, "data-cold": choice.warm ? null : "",
    }));
  }
  sampler.value = info.defaults.sampler;

  $("steps").value = info.defaults.steps;
  $("guidance").value = info.defaults.guidance_scale;
  if (!$("negative_prompt").value) $("negative_prompt").value = info.defaults.negative_prompt || "";
  $("count").max = info.max_images_per_request;
  $("count").title = `at most ${info.max_images_per_request} per request`;

  const loras = $("loras");
  loras.querySelectorAll("label").forEach((label) => label.remove());
  $("loras-none").hidden = info.loras.length > 0;
  for (const name of info.loras) {
    loras.append(element("label", {},
      element("input", { type: "checkbox", name: "lora", value: name }),
      name,
      element("input", { type: "number", name: "lora-scale", "data-lora": name, value: "1", step: "0.1",
                         "aria-label": `${name} scale` })));
  }
  $("shape-note").textContent =
    `serve.new_shapes: ${info.new_shapes}, ` +
    (info.new_shapes === "compile"
      ? "a size or sampler not warm compiles once (minutes on a TPU), then stays warm."
      : "a size or sampler not warm is refused.") +
    (info.cfg ? " Guidance 1 or less turns CFG off: another shape." : "");
}

function clearErrors() {
  document.querySelectorAll("#make-form .error").forEach((node) => (node.textContent = ""));
  document.querySelectorAll("#make-form .field.invalid").forEach((node) => node.classList.remove("invalid"));
}

function showErrors(lines) {
  for (const line of lines) {
    const found = FIELD_OF_LINE.find(([pattern]) => pattern.test(line));
    const target = $(`${found ? found[1] : "form"}-error`);
    target.textContent = target.textContent ? `${target.textContent}\n${line}` : line;
    if (found) target.closest(".field").classList.add("invalid");
  }
}

function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function requestBody(taskId) {
  const [width, height] = $("size").value.split("x").map(Number);
  const tags = [...document.querySelectorAll('#loras input[name="lora"]:checked')].map((box) => {
    const scale = document.querySelector(`#loras input[data-lora="${CSS.escape(box.value)}"]`).value || "1";
    return `<lora:${box.value}:${scale}>`;
  });
  return {
    prompt: [$("prompt").value, ...tags].join(" ").trim(),
    negative_prompt: $("negative_prompt").value,
    width, height,
    sampler_name: $("sampler").value || undefined,
    steps: number("steps"),
    cfg_scale: number("guidance"),
    seed: number("seed") ?? -1,
    batch_size: number("count") ?? 1,
    n_iter: 1,
    force_task_id: taskId,
  };
}

async function watchTask(taskId, stopped) {
  const bar = $("progress-bar");
  const text = $("progress-text");
  while (!stopped.done) {
    await sleep(PROGRESS_EVERY_MS);
    if (stopped.done) return;
    try {
      const state = await callJSON("/internal/progress", { method: "POST", body: { id_task: taskId }, busyRetries: false });
      if (stopped.done) return;
      if (typeof state.progress === "number") bar.value = state.progress;
      const eta = typeof state.eta === "number" ? `, about ${Math.ceil(state.eta)} s left` : "";
      text.textContent = (state.textinfo || "") + eta;
    } catch (error) {
      // a missed poll is not an error of the request
    }
  }
}

function showResults(reply, count) {
  const info = JSON.parse(reply.info || "{}");
  const group = element("div", { className: "request" });
  reply.images.forEach((b64, i) => {
    const parameters = (info.infotexts || [])[i] || "";
    const seed = (info.all_seeds || [])[i];
    const src = `data:image/png;base64,${b64}`;
    const copy = element("button", { type: "button", className: "copy", text: "Copy parameters" });
    const text = element("pre", { className: "parameters", text: parameters });
    copy.addEventListener("click", () => copyText(parameters, copy));
    group.append(element("figure", { className: "result" },
      element("img", { src, alt: info.prompt || "image", width: info.width, height: info.height }),
      element("figcaption", {}, text,
        element("div", { className: "actions" }, copy,
          element("a", { className: "download", href: src, download: `tpugen-${seed ?? i}.png`, text: "Download PNG" })))));
  });
  if (reply.images.length < count) {
    group.append(element("p", { className: "hint", text: `${reply.images.length} of ${count} images (interrupted)` }));
  }
  $("results").prepend(group);
}

$("make-form").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    $("make-form").requestSubmit();
  }
});

$("make-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const button = $("make");
  if (button.disabled) return;
  clearErrors();
  const taskId = `page-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
  const body = requestBody(taskId);
  const stopped = { done: false };
  button.disabled = true;
  $("progress").hidden = false;
  $("progress-bar").value = 0;
  $("progress-text").textContent = "sent";
  watchTask(taskId, stopped);
  try {
    const response = await call("/sdapi/v1/txt2img", { method: "POST", body });
    if (!response.ok) {
      showErrors(await linesOf(response));
      return;
    }
    $("progress-bar").value = 1;
    showResults(await response.json(), body.batch_size);
    refreshStatus();
  } catch (error) {
    showErrors([`the request failed: ${error.message}`]);
  } finally {
    stopped.done = true;
    button.disabled = false;
    $("progress").hidden = true;
  }
});

// ---------------------------------------------------------------- runs

let runsNext = null;

function runRow(run) {
  const bar = element("progress", { max: run.images_planned || 1, value: run.images });
  return element("tr", { "data-run": run.id },
    element("td", {}, element("a", { href: `#/runs/${encodeURIComponent(run.id)}`, text: run.id })),
    element("td", { className: `status-${run.status}`, text: run.status }),
    element("td", { className: "number", text: `${run.images} of ${run.images_planned}` }),
    element("td", {}, bar));
}

async function showRuns(more = false) {
  const body = $("runs").tBodies[0];
  const path = `/v1/runs?limit=20` + (more && runsNext ? `&after=${encodeURIComponent(runsNext)}` : "");
  try {
    const page = await callJSON(path);
    if (!more) body.replaceChildren();
    page.runs.forEach((run) => body.append(runRow(run)));
    runsNext = page.next;
    $("runs-more").hidden = !page.next;
    $("runs-empty").hidden = body.rows.length > 0;
  } catch (error) {
    $("runs-empty").hidden = false;
    $("runs-empty").textContent = error.message;
  }
}

$("runs-refresh").addEventListener("click", () => showRuns());
$("runs-more").addEventListener("click", () => showRuns(true));

// ---------------------------------------------------------------- a run

let runView = null; // { id, offset, events: AbortController }

async function showRun(runId) {
  if (runView && runView.events) runView.events.abort();
  forgetBlobs();
  runView = { id: runId, offset: 0, events: null };
  $("run-id").textContent = runId;
  $("gallery").replaceChildren();
  $("report").replaceChildren();
  $("run-progress").hidden = true;
  const view = runView;
  let status;
  try {
    status = await callJSON(`/v1/runs/${encodeURIComponent(runId)}`);
  } catch (error) {
    $("run-status").textContent = error.message;
    return;
  }
  if (view !== runView) return;
  showRunStatus(status);
  await showGallery(0);
  if (status.status === "queued" || status.status === "running") followRun(view);
}

function showRunStatus(status) {
  const line = [`${status.status}: ${status.images} of ${status.images_planned} images`];
  if (status.error && status.error.length) line.push(status.error.join("; "));
  $("run-status").textContent = line.join(". ");
  $("run-status").className = `status-${status.status}`;
  if (status.report) showReport(status.report);
}

function followRun(view) {
  view.events = new AbortController();
  $("run-progress").hidden = false;
  const bar = $("run-progress-bar");
  const text = $("run-progress-text");
  let shown = 0;
  readEvents(`/v1/runs/${encodeURIComponent(view.id)}/events`, (name, data) => {
    if (view !== runView) return;
    bar.max = data.images_planned || 1;
    bar.value = data.images_done;
    text.textContent = `${data.state || data.status}: ${data.images_done} of ${data.images_planned} images` +
      (data.steps ? `, step ${data.step} of ${data.steps}` : "");
    if (data.images_done !== shown && view.offset === 0) {
      shown = data.images_done;
      showGallery(0);
    }
    if (name === "end") {
      $("run-progress").hidden = true;
      showRun(view.id);
    }
  }, view.events.signal).catch(() => {});
}

const lazyImages = "IntersectionObserver" in window
  ? new IntersectionObserver((entries, observer) => {
    for (const entry of entries) {
      if (!entry.isIntersecting) continue;
      observer.unobserve(entry.target);
      loadThumb(entry.target);
    }
  }, { rootMargin: "200px" })
  : null;

async function loadThumb(img) {
  try {
    img.src = await fileUrl(img.dataset.src);
  } catch (error) {
    img.alt = error.message;
  }
}

async function showGallery(offset) {
  const view = runView;
  const id = encodeURIComponent(view.id);
  let page;
  try {
    page = await callJSON(`/v1/runs/${id}/images?offset=${offset}&limit=${PAGE_SIZE}`);
  } catch (error) {
    $("gallery").replaceChildren(element("p", { className: "error", text: error.message }));
    return;
  }
  if (view !== runView) return;
  view.offset = offset;
  const thumbs = page.images.map((image) => {
    const path = `/v1/runs/${id}/files/${encodeURIComponent(image.file)}`;
    // Without a key the browser's own lazy loading fetches it; with one, the observer does once it is near.
    const img = element("img", {
      loading: "lazy", alt: image.prompt || image.file, width: image.width, height: image.height,
      "data-src": path, src: apiKey() || !lazyImages ? null : path,
    });
    if (apiKey()) lazyImages ? lazyImages.observe(img) : loadThumb(img);
    const link = element("a", { href: "#", title: image.file, "data-index": image.index }, img);
    link.addEventListener("click", (event) => {
      event.preventDefault();
      openViewer(image, path, img);
    });
    return link;
  });
  $("gallery").replaceChildren(...thumbs);
  const pages = Math.max(1, Math.ceil(page.total / PAGE_SIZE));
  $("gallery-pages").hidden = pages < 2;
  $("gallery-page").textContent = `page ${Math.floor(offset / PAGE_SIZE) + 1} of ${pages} (${page.total} images)`;
  $("gallery-prev").disabled = offset === 0;
  $("gallery-next").disabled = page.next === null;
}

$("gallery-prev").addEventListener("click", () => showGallery(Math.max(0, runView.offset - PAGE_SIZE)));
$("gallery-next").addEventListener("click", () => showGallery(runView.offset + PAGE_SIZE));

async function openViewer(image, path, thumb) {
  const viewer = $("viewer");
  const src = thumb.currentSrc || thumb.src || (await fileUrl(path));
  $("viewer-img").src = src;
  $("viewer-img").alt = image.prompt || image.file;
  $("viewer-parameters").textContent = image.parameters || "";
  $("viewer-download").href = src;
  $("viewer-download").download = image.file;
  if (!viewer.open) viewer.showModal();
}

$("viewer-copy").addEventListener("click", () => copyText($("viewer-parameters").textContent, $("viewer-copy")));
$("viewer-close").addEventListener("click", () => $("viewer").close());

function table(head, rows) {
  return element("table", {},
    element("thead", {}, element("tr", {}, ...head.map((h) => element("th", { text: h })))),
    element("tbody", {}, ...rows.map((row) => element("tr", {}, ...row.map((cell) => element("td", { text: cell }))))));
}

function shapeText(shape) {
  return typeof shape === "string" ? shape : JSON.stringify(shape);
}

function showReport(report) {
  const timed = report.timed_phase || {};
  const latency = timed.per_image_seconds || {};
  const device = report.device || {};
  const model = report.model || {};
  const compiles = report.compiles_after_warmup;
  const facts = [
    ["status", report.complete ? "complete" : `incomplete${report.error ? ": " + report.error : ""}`],
    ["model", `${model.id || "n/a"} (${model.dtype || "n/a"}, scheduler ${model.scheduler || "n/a"})`],
    ["device", `${device.backend || "n/a"} on ${device.device_kind || "n/a"}`],
    ["images", `${report.images} of ${report.images_planned ?? "n/a"} in ${report.batches ?? "n/a"} batches`],
    ["model load", `${fixed(report.model_load_seconds)} s`],
    ["warmup", `${fixed(report.warmup_seconds)} s`],
    ["timed phase", `${fixed(timed.wall_seconds)} s wall, ${fixed(timed.images_per_second)} images/s`],
    ["seconds per image", `mean ${fixed(latency.mean, 3)}, p50 ${fixed(latency.p50, 3)}, p90 ${fixed(latency.p90, 3)}, p99 ${fixed(latency.p99, 3)}`],
    ["seconds per step", fixed(timed.seconds_per_step, 4)],
    ["compiles after warmup", compiles === null || compiles === undefined ? "n/a" : String(compiles)],
  ];
  const list = element("dl", { id: "report-facts" });
  for (const [name, value] of facts) {
    list.append(element("dt", { text: name }),
      element("dd", { text: value, className: name === "compiles after warmup" && compiles > 0 ? "bad" : null }));
  }
  const warmup = (report.warmup || []).map((entry) => entry.already_warm
    ? [shapeText(entry.shape_key), "0.00", "0", "0.00 (already warm)"]
    : [shapeText(entry.shape_key), fixed(entry.seconds), fixed(entry.compiles, 0), fixed(entry.compile_seconds)]);
  const batches = (timed.batches || []).map((b) =>
    [["worker", "rank", "batch"].filter((k) => k in b).map((k) => b[k]).join("."), shapeText(b.shape_key),
     String(b.images), fixed(b.seconds, 3), fixed(b.compiles, 0)]);
  const recompiles = (report.recompiles || []).map((event) =>
    element("li", { text: `batch ${event.batch} (${shapeText(event.shape_key)}) compiled ${event.compiles} graphs` }));
  const warmupTable = table(["shape key", "wall s", "graphs compiled", "compile s"],
    warmup.length ? warmup : [["(skipped)", "", "", ""]]);
  const batchTable = table(["batch", "shape key", "images", "seconds", "compiles"], batches);
  warmupTable.id = "report-warmup";
  batchTable.id = "report-batches";
  $("report").replaceChildren(
    element("div", {}, element("h3", { text: "Report" }), list),
    element("div", {},
      element("h3", { text: "Warmup (compile) per shape key" }), warmupTable,
      element("h3", { text: "Timed phase, per batch" }), batchTable,
      ...(recompiles.length ? [element("h3", { text: "Recompiles" }), element("ul", {}, ...recompiles)] : [])));
}

// ---------------------------------------------------------------- views

function route() {
  const hash = location.hash || "#/make";
  const run = hash.match(/^#\/runs\/(.+)$/);
  const name = run ? "run" : hash.startsWith("#/runs") ? "runs" : "make";
  for (const view of ["make", "runs", "run"]) $(`view-${view}`).hidden = view !== name;
  for (const [link, current] of [["nav-make", name === "make"], ["nav-runs", name !== "make"]]) {
    if (current) $(link).setAttribute("aria-current", "page");
    else $(link).removeAttribute("aria-current");
  }
  if (name !== "run" && runView && runView.events) runView.events.abort();
  if (name === "runs") showRuns();
  if (name === "run") showRun(decodeURIComponent(run[1]));
  if (name === "make") $("prompt").focus();
}

async function start() {
  window.addEventListener("hashchange", route);
  refreshStatus();
  setInterval(refreshStatus, STATUS_EVERY_MS);
  route();
  for (;;) {
    try {
      server = await callJSON("/v1/server");
      break;
    } catch (error) {
      $("form-error").textContent = error.message; // e.g. failed: the status line above says why
      await sleep(STATUS_EVERY_MS);
    }
  }
  $("form-error").textContent = "";
  fillForm(server);
  showServer(server);
}

start();
