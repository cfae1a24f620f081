// voice_out demo page: a WebRTC client of the voice_out server (design: protocol v1 on the
// data channel "voice_out", audio on one recvonly transceiver), and the measurement hooks that
// the browser test reads from window.voiceOut. No framework, no build step, no external URLs.
//
// Times are performance.now() milliseconds unless a name says otherwise. "Audible" means the
// RMS of a 128-frame block of the received audio, as WebAudio decoded it, is at or above
// voiceOut.audio.threshold.

const CHANNEL_LABEL = "voice_out";
// RMS; about -66 dBFS. Opus-decoded digital silence (the track between utterances) is far
// below it, and quiet sound is above it: the noise of random-weight models (RMS 0.0015 to
// 0.003) must count as audible too, or the page shows nothing at all for them.
const DEFAULT_THRESHOLD = 0.0005;
const METER_FLOOR_DB = -72; // the level meter and its dBFS reading span METER_FLOOR_DB..0 dBFS
const WAVE_MAX_GAIN = 200; // the waveform scales quiet audio up to this many times, to fill its height
const WAVE_GAIN_DECAY = 0.97; // per frame: the waveform's gain recovers slowly after a loud peak
const SILENCE_HOLD_MS = 250; // below the threshold this long = silence (bridges pauses between words)
const MIC_SPEECH_MS = 200; // microphone above its threshold this long = the person is talking
const MIC_POLL_MS = 20;
const ICE_GATHERING_TIMEOUT_MS = 3000;
const SESSION_READY_TIMEOUT_MS = 10000;
const CLOCK_WINDOW_REPORTS = 50; // level reports (~10 ms each) that set the audio-clock offset
const LEVEL_HISTORY_BLOCKS = 8192; // ~20 s of 128-frame blocks, for voiceOut.levels()
const MAX_LOG_ROWS = 400; // rows kept in the DOM; voiceOut.log keeps everything
const TERMINAL = new Set(["done", "cancelled", "error"]);
// ?ice=relay: connect through the server's TURN relays only, as a client behind a NAT that
// lets nothing else through would (the TURN test uses it); else every candidate type.
const ICE_TRANSPORT_POLICY = new URLSearchParams(location.search).get("ice") === "relay" ? "relay" : "all";
const ERRORS_ENDING_UTTERANCE = new Set([
  "unknown_voice",
  "no_voice",
  "voice_unusable",
  "too_many_utterances",
  "overloaded",
  "not_ready",
  "internal",
  // the page sends well-formed messages: bad_field is an option of the first delta the
  // server refused (fast_first), and unknown_id names an utterance that never started
  "bad_field",
  "unknown_id",
]);

const $ = (id) => document.getElementById(id);
const now = () => performance.now();
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ---------------------------------------------------------------------------------------------
// Measurement state, exposed for tests and for anyone poking at the page from the console.

const audio = {
  threshold: DEFAULT_THRESHOLD,
  audible: false, // current detector state
  lastAudibleEnd: null, // end of the last audible block
  onsets: [], // [{t, rms}] first audible block after silence
  silences: [], // [{t, lastAudible}] t: when silence was decided; lastAudible: end of the last audible block
  maxRms: 0,
  level: 0,
  audibleMs: 0, // total audible time received
  blocks: 0, // audio blocks measured (the audio clock is running while this grows)
  meter: "none", // "worklet" | "analyser" | "none"
  trackReceived: false,
};

const state = {
  pc: null,
  dc: null,
  sessionId: null,
  sampleRate: null,
  nextId: 1,
  utteranceOrder: [], // ids in the order they were started
  defaultVoice: undefined, // the server's default voice: a name, null (none), undefined (not known)
  waveGain: 1,
  streamers: new Set(), // running "stream like an LLM" loops
  pendingCancels: [], // barge-ins waiting for silence
  audioCtx: null,
  graphInput: null, // where the remote stream is connected
  analyser: null,
  levelHistory: [], // [[block end, rms]] of the latest blocks
  clockOffsets: [], // performance.now() - audio-clock ms of the latest level reports
  mic: null, // {stream, analyser, timer, speechMs}
  recorder: null,
  recordedWav: null,
  readyWaiters: [],
};

const voiceOut = {
  loaded: false,
  log: [], // every protocol message and page measurement: {t, dir: "out"|"in"|"page"|"http", type, msg}
  marks: {}, // first time each named moment happened
  utterances: {}, // id -> timings, see newUtterance()
  bargeIns: [], // {at, reason, ids, lastAudibleAt, silenceAt, ms}
  audio,
  connect,
  disconnect,
  speak,
  stream: startStream,
  cancel,
  ping,
  listVoices,
  uploadVoice,
  deleteVoice,
  record: recordFor,
  micBargeIn: setMicBargeIn, // (on: boolean) -> Promise
  micVad: { speechMs: MIC_SPEECH_MS }, // the threshold is the page's slider
  setThreshold(value) {
    audio.threshold = value;
  },
  summary,
  rtpStats,
  candidatePair,
  resetMeasurements,
  /** [[block end ms, rms]] of the received audio between two times (the latest ~20 s). */
  levels(from = -Infinity, to = Infinity) {
    return state.levelHistory.filter(([t]) => t >= from && t <= to);
  },
};
window.voiceOut = voiceOut;

function mark(name, t = now()) {
  if (!(name in voiceOut.marks)) voiceOut.marks[name] = t;
  return t;
}

function summary() {
  // A JSON-safe snapshot: what the test reads in one evaluation.
  return JSON.parse(
    JSON.stringify({
      sessionId: state.sessionId,
      sampleRate: state.sampleRate,
      connection: state.pc ? state.pc.connectionState : "none",
      channel: state.dc ? state.dc.readyState : "none",
      audioContext: state.audioCtx ? state.audioCtx.state : "none",
      now: now(),
      marks: voiceOut.marks,
      utterances: voiceOut.utterances,
      bargeIns: voiceOut.bargeIns,
      audio,
      events: voiceOut.log.filter((e) => e.dir === "in").map((e) => ({ t: e.t, ...e.msg })),
    }),
  );
}

/** The receiving side of the audio track, from WebRTC's own statistics. */
async function rtpStats() {
  if (!state.pc) return null;
  const stats = await state.pc.getStats();
  for (const r of stats.values()) {
    if (r.type === "inbound-rtp" && r.kind === "audio") {
      const emitted = r.jitterBufferEmittedCount || 0;
      return {
        packetsReceived: r.packetsReceived,
        packetsLost: r.packetsLost,
        jitterMs: (r.jitter || 0) * 1000,
        // Average time a sample waited in the jitter buffer: the floor of barge-in latency.
        jitterBufferMs: emitted ? (1000 * r.jitterBufferDelay) / emitted : null,
        jitterBufferTargetMs: emitted && r.jitterBufferTargetDelay ? (1000 * r.jitterBufferTargetDelay) / emitted : null,
        // The running totals behind the averages (seconds, samples): the difference of two
        // readings gives the average over the samples played in between.
        jitterBufferDelayS: r.jitterBufferDelay || 0,
        jitterBufferEmittedCount: emitted,
        concealedSamples: r.concealedSamples,
        totalSamplesReceived: r.totalSamplesReceived,
      };
    }
  }
  return null;
}

/** The ICE candidate pair the connection uses (WebRTC's statistics), each side's type (host,
 * srflx, prflx, relay) and address, and the candidate types each side offered in its SDP. */
async function candidatePair() {
  if (!state.pc) return null;
  const stats = await state.pc.getStats();
  const candidate = (id) => {
    const c = stats.get(id);
    if (!c) return null;
    const { candidateType: type, protocol, address, port } = c;
    return { type, protocol, address, port, relayProtocol: c.relayProtocol ?? null };
  };
  const sdpTypes = (desc) => [...new Set(Array.from((desc?.sdp ?? "").matchAll(/ typ (\w+)/g), (m) => m[1]))];
  let pair = null;
  for (const r of stats.values()) {
    if (r.type === "transport" && r.selectedCandidatePairId) pair = stats.get(r.selectedCandidatePairId) ?? null;
  }
  return {
    policy: ICE_TRANSPORT_POLICY,
    iceServers: state.pc.getConfiguration().iceServers.map((s) => s.urls),
    offered: { local: sdpTypes(state.pc.localDescription), remote: sdpTypes(state.pc.remoteDescription) },
    selected: pair && {
      state: pair.state,
      bytesReceived: pair.bytesReceived,
      local: candidate(pair.localCandidateId),
      remote: candidate(pair.remoteCandidateId),
    },
  };
}

function resetMeasurements() {
  voiceOut.marks = {};
  voiceOut.bargeIns = [];
  audio.onsets = [];
  audio.silences = [];
  audio.maxRms = 0;
  audio.audibleMs = 0;
}

// ---------------------------------------------------------------------------------------------
// Event log

function record(dir, type, msg) {
  const entry = { t: now(), dir, type, msg };
  voiceOut.log.push(entry);
  renderLogEntry(entry);
  return entry;
}

function describe(type, msg) {
  switch (type) {
    case "session.ready":
      return `session ${msg.session_id} · ${msg.sample_rate} Hz · voices: ${(msg.voices || []).map(voiceName).join(", ") || "none"}`;
    case "text.delta":
      return `${msg.id} ${JSON.stringify(msg.delta)}${msg.voice ? ` (voice ${msg.voice})` : ""}${
        msg.fast_first != null ? ` (fast first ${msg.fast_first})` : ""
      }`;
    case "audio.started":
      return `${msg.id} · server TTFA ${fmtMs(msg.ttfa_ms)}`;
    case "audio.done":
      return `${msg.id} · ${fmtMs(msg.audio_ms)} of audio`;
    case "cancelled":
      return `${msg.id} · played ${fmtMs(msg.played_ms)}: ${JSON.stringify(msg.played_text ?? "")}`;
    case "error":
      return `${msg.id ?? "-"} · ${msg.code}: ${msg.message}`;
    case "pong":
      return `t=${msg.t} · round trip ${fmtMs(now() - msg.t)}`;
    case "text.done":
      return msg.id;
    case "cancel":
      return msg.id ? `${msg.id} and after` : "everything";
    case "audible":
      return `${msg.id ? `${msg.id} · page TTFA ${fmtMs(msg.page_ttfa_ms)} · ` : ""}rms ${msg.rms}`;
    case "silence":
      return `last audible sample at ${(msg.last_audible_ms / 1000).toFixed(3)} s`;
    case "barge-in":
      return msg.last_audible_after_cancel_ms > 0
        ? `${msg.reason}: silent ${fmtMs(msg.last_audible_after_cancel_ms)} after the cancel`
        : `${msg.reason}: it was already quiet when the cancel went out, and stayed so`;
    case "connection":
      return msg.state;
    case "voices":
      return msg.voices.join(", ") || "none";
    case "voice added":
    case "voice deleted":
      return msg.name;
    case "answer":
      return `session ${msg.session_id}`;
    case "mic":
      return `${msg.note} (rms ${msg.rms})`;
    default: {
      const rest = { ...msg };
      delete rest.type;
      return Object.keys(rest).length ? JSON.stringify(rest) : "";
    }
  }
}

function renderLogEntry(entry) {
  const list = $("log");
  if (!list) return;
  const li = document.createElement("li");
  li.className = entry.dir + (entry.type === "error" ? " error" : "") + (entry.type === "text.delta" ? " delta" : "");
  const arrow = { out: "→", in: "←", page: "•", http: "⇄" }[entry.dir] || "";
  const cells = [
    ["t", `${(entry.t / 1000).toFixed(3)} s`],
    ["dir", arrow],
    ["type", entry.type],
    ["detail", describe(entry.type, entry.msg || {})],
  ];
  for (const [cls, text] of cells) {
    const span = document.createElement("span");
    span.className = cls;
    span.textContent = text;
    li.append(span);
  }
  const atBottom = list.scrollTop + list.clientHeight >= list.scrollHeight - 4;
  list.append(li);
  while (list.childElementCount > MAX_LOG_ROWS) list.firstElementChild.remove();
  if (atBottom) list.scrollTop = list.scrollHeight;
}

function fmtMs(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "–";
  return ms >= 10000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

// ---------------------------------------------------------------------------------------------
// HTTP

function authHeaders() {
  const token = $("token").value.trim();
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function api(method, path, body) {
  const headers = authHeaders();
  let payload = body;
  if (body !== undefined && !(body instanceof FormData)) {
    headers["Content-Type"] = "application/json";
    payload = JSON.stringify(body);
  }
  const res = await fetch(path, { method, headers, body: payload, cache: "no-store" });
  const text = await res.text();
  let data = text;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    // not JSON: keep the text for the error message
  }
  if (!res.ok) {
    const detail =
      (data && typeof data === "object" && (data.message || data.error?.message || data.error)) ||
      text ||
      res.statusText;
    const hint = res.status === 401 ? " (set the bearer token)" : "";
    throw new Error(`${method} ${path}: HTTP ${res.status} ${detail}${hint}`);
  }
  return data;
}

// ---------------------------------------------------------------------------------------------
// Audio: one AudioContext; remote stream -> level meter -> analyser (waveform) -> speakers.

async function ensureAudio() {
  if (state.audioCtx) {
    if (state.audioCtx.state === "suspended") await state.audioCtx.resume();
    return state.audioCtx;
  }
  const ctx = new AudioContext({ latencyHint: "interactive" });
  state.audioCtx = ctx;
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 2048;
  analyser.connect(ctx.destination);
  state.analyser = analyser;
  try {
    await ctx.audioWorklet.addModule("meter-worklet.js");
    const meter = new AudioWorkletNode(ctx, "level-meter", { numberOfInputs: 1, numberOfOutputs: 1 });
    meter.port.onmessage = (e) => onLevelReport(e.data);
    meter.connect(analyser);
    state.graphInput = meter;
    audio.meter = "worklet";
  } catch (err) {
    // No AudioWorklet (for example an insecure origin): poll the analyser instead.
    record("page", "meter", { note: `AudioWorklet unavailable (${err}); polling an AnalyserNode` });
    state.graphInput = analyser;
    audio.meter = "analyser";
    startAnalyserPolling(analyser);
  }
  if (ctx.state === "suspended") await ctx.resume();
  requestAnimationFrame(drawWaveform);
  return ctx;
}

function onLevelReport(report) {
  // report: Float64Array of [start s, end s, rms, peak] per block, audio-clock seconds.
  const arrival = now();
  const lastEnd = report[report.length - 3] * 1000;
  // Map the audio clock onto performance.now(). The smallest (arrival - audio time) among
  // recent reports is the best estimate of the offset: that report waited least in the
  // message queue. Only recent ones count, because the two clocks drift apart (a fake or
  // starved audio device runs slow or fast).
  const offsets = state.clockOffsets;
  offsets.push(arrival - lastEnd);
  if (offsets.length > CLOCK_WINDOW_REPORTS) offsets.shift();
  const offset = Math.min(...offsets);
  for (let i = 0; i < report.length; i += 4) {
    onAudioBlock(report[i] * 1000 + offset, report[i + 1] * 1000 + offset, report[i + 2], report[i + 3]);
  }
}

function startAnalyserPolling(analyser) {
  const buf = new Float32Array(analyser.fftSize);
  const pollMs = 10;
  const n = Math.min(buf.length, Math.round((state.audioCtx.sampleRate * pollMs) / 1000));
  setInterval(() => {
    analyser.getFloatTimeDomainData(buf);
    let sum = 0;
    let peak = 0;
    for (let i = buf.length - n; i < buf.length; i++) {
      sum += buf[i] * buf[i];
      peak = Math.max(peak, Math.abs(buf[i]));
    }
    const t = now();
    onAudioBlock(t - pollMs, t, Math.sqrt(sum / n), peak);
  }, pollMs);
}

function onAudioBlock(start, end, rms, _peak) {
  audio.blocks += 1;
  state.levelHistory.push([end, rms]);
  if (state.levelHistory.length > LEVEL_HISTORY_BLOCKS) state.levelHistory.splice(0, LEVEL_HISTORY_BLOCKS / 4);
  audio.level = rms;
  if (rms > audio.maxRms) audio.maxRms = rms;
  if (rms >= audio.threshold) {
    audio.audibleMs += end - start;
    if (!audio.audible) {
      audio.audible = true;
      onOnset(start, rms);
    }
    audio.lastAudibleEnd = end;
  } else if (audio.audible && end - audio.lastAudibleEnd >= SILENCE_HOLD_MS) {
    audio.audible = false;
    audio.silences.push({ t: end, lastAudible: audio.lastAudibleEnd });
    record("page", "silence", { last_audible_ms: Math.round(audio.lastAudibleEnd) });
  }
  if (state.pendingCancels.length > 0 && !audio.audible) {
    const lastAudible = audio.lastAudibleEnd ?? -Infinity;
    for (const cancel of state.pendingCancels.filter((c) => end - Math.max(c.at, lastAudible) >= SILENCE_HOLD_MS)) {
      cancel.lastAudibleAt = lastAudible > -Infinity ? lastAudible : null;
      cancel.ms = Math.max(0, lastAudible - cancel.at);
      cancel.silenceAt = end;
      state.pendingCancels.splice(state.pendingCancels.indexOf(cancel), 1);
      mark("silenceAfterCancel", end);
      $("stat-bargein").textContent = cancel.ms > 0 ? fmtMs(cancel.ms) : "0 ms (quiet)";
      record("page", "barge-in", { reason: cancel.reason, last_audible_after_cancel_ms: Math.round(cancel.ms) });
    }
  }
}

function onOnset(t, rms) {
  const onset = { t, rms, id: null };
  audio.onsets.push(onset);
  mark("firstAudible", t);
  const u = waitingForFirstAudio(t);
  const detail = { rms: Number(rms.toFixed(4)) };
  if (u && heardAfterServerSent(u, t)) attributeOnset(u, onset, detail);
  record("page", "audible", detail);
}

/**
 * The utterance whose first sound an onset at `t` can be: the first one started whose first
 * audio has not been heard, not cut or refused, sent before `t`. Utterances play in order, so
 * it is never one behind an earlier one still unheard.
 */
function waitingForFirstAudio(t) {
  return state.utteranceOrder
    .map((id) => voiceOut.utterances[id])
    .find(
      (x) =>
        x.firstDeltaAt !== null &&
        x.firstDeltaAt <= t &&
        x.firstAudibleAt === null &&
        !x.cancelSentAt &&
        x.status !== "error" &&
        x.status !== "cancelled",
    );
}

/**
 * Whether a sound heard at `t` can be `u`'s: the server has said its first frame went onto the
 * track (audio.started) and `t` is not before that moment (first delta sent + the server's
 * TTFA). Without this, the sound after a pause in the previous utterance was taken for the
 * first sound of the next, queued one, and the page's TTFA read lower than the server's.
 */
function heardAfterServerSent(u, t) {
  return u.startedAt !== null && u.serverTtfaMs !== null && t >= u.firstDeltaAt + u.serverTtfaMs;
}

function attributeOnset(u, onset, detail = {}) {
  onset.id = u.id;
  u.firstAudibleAt = onset.t;
  u.pageTtfaMs = onset.t - u.firstDeltaAt;
  detail.id = u.id;
  detail.page_ttfa_ms = Math.round(u.pageTtfaMs);
  $("stat-page-ttfa").textContent = fmtMs(u.pageTtfaMs);
  return detail;
}

/**
 * audio.started of `u` has arrived: its first sound may have been heard already (the event
 * and the audio travel apart). Take the earliest onset since the server sent it that no
 * utterance owns.
 */
function onAudioStarted(u) {
  if (u.firstAudibleAt !== null || waitingForFirstAudio(now()) !== u) return;
  const onset = audio.onsets.find((o) => o.id === null && o.t >= u.firstDeltaAt && heardAfterServerSent(u, o.t));
  if (onset) record("page", "audible", attributeOnset(u, onset, { rms: Number(onset.rms.toFixed(4)) }));
}

function attachRemoteStream(stream) {
  audio.trackReceived = true;
  // Chrome only pulls a remote WebRTC track into WebAudio while a media element plays it; the
  // element stays muted and WebAudio does the playing (so the meter measures what is heard).
  const el = $("remote-audio");
  el.srcObject = stream;
  el.muted = true;
  el.play().catch(() => {});
  const source = state.audioCtx.createMediaStreamSource(stream);
  source.connect(state.graphInput);
  record("page", "track", { id: stream.id });
}

function drawWaveform() {
  const canvas = $("waveform");
  const analyser = state.analyser;
  if (!canvas || !analyser) return;
  const dpr = window.devicePixelRatio || 1;
  const width = Math.round(canvas.clientWidth * dpr);
  const height = Math.round(canvas.clientHeight * dpr);
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  const g = canvas.getContext("2d");
  const samples = new Float32Array(analyser.fftSize);
  analyser.getFloatTimeDomainData(samples);
  // Scale quiet audio up to fill the height (a random-weight model's noise is ~-50 dBFS, a flat
  // line at unit gain); the gain drops at once for a louder peak and recovers slowly.
  let peak = 0;
  for (const x of samples) peak = Math.max(peak, Math.abs(x));
  const fit = peak > 0 ? Math.min(WAVE_MAX_GAIN, 0.9 / peak) : WAVE_MAX_GAIN;
  state.waveGain = Math.min(fit, Math.max(1, state.waveGain / WAVE_GAIN_DECAY));
  const gain = state.waveGain;
  const style = getComputedStyle(document.documentElement);
  g.clearRect(0, 0, width, height);
  g.strokeStyle = style.getPropertyValue("--border");
  g.lineWidth = 1;
  g.beginPath();
  g.moveTo(0, height / 2);
  g.lineTo(width, height / 2);
  g.stroke();
  g.strokeStyle = style.getPropertyValue("--wave");
  g.lineWidth = 2 * dpr;
  g.beginPath();
  for (let i = 0; i < samples.length; i++) {
    const x = (i / (samples.length - 1)) * width;
    const y = height / 2 - Math.max(-1, Math.min(1, samples[i] * gain)) * (height / 2 - 2);
    if (i === 0) g.moveTo(x, y);
    else g.lineTo(x, y);
  }
  g.stroke();
  g.fillStyle = style.getPropertyValue("--muted") || "gray";
  g.font = `${11 * dpr}px sans-serif`;
  g.fillText(`×${gain < 10 ? gain.toFixed(1) : Math.round(gain)}`, 4 * dpr, 12 * dpr);
  const db = levelDb(audio.level);
  $("out-level").value = Math.max(0, (db - METER_FLOOR_DB) / -METER_FLOOR_DB);
  $("out-db").textContent = db > METER_FLOOR_DB ? `${Math.round(db)} dBFS` : "silent";
  requestAnimationFrame(drawWaveform);
}

// ---------------------------------------------------------------------------------------------
// Connection

/** RMS -> dBFS (-Infinity for silence). */
function levelDb(rms) {
  return rms > 0 ? 20 * Math.log10(rms) : -Infinity;
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = `pill pill-${kind}`;
}

function channelOpen() {
  return state.dc !== null && state.dc.readyState === "open";
}

function updateButtons() {
  const open = channelOpen();
  for (const id of ["speak", "stream", "cancel", "ping"]) $(id).disabled = !open;
  $("connect").textContent = state.pc ? "Disconnect" : "Connect";
}

async function connect() {
  if (state.pc) return state.sessionId;
  mark("connectStarted");
  setStatus("connecting", "busy");
  await ensureAudio();
  let iceServers;
  try {
    // server.ice_servers (STUN/TURN, with credentials): empty on a LAN
    iceServers = (await api("GET", "/ice-servers")).ice_servers;
  } catch (err) {
    throw connectFailed(err);
  }
  const pc = new RTCPeerConnection({ iceServers, iceTransportPolicy: ICE_TRANSPORT_POLICY });
  state.pc = pc;
  updateButtons();
  const dc = pc.createDataChannel(CHANNEL_LABEL, { ordered: true });
  state.dc = dc;
  pc.addTransceiver("audio", { direction: "recvonly" });
  pc.ontrack = (e) => attachRemoteStream(e.streams[0] || new MediaStream([e.track]));
  pc.onconnectionstatechange = () => {
    record("page", "connection", { state: pc.connectionState });
    if (pc.connectionState === "failed") setStatus("connection failed", "error");
    if (pc.connectionState === "disconnected") setStatus("connection lost", "error");
  };
  dc.onopen = () => updateButtons();
  dc.onclose = () => {
    updateButtons();
    if (state.dc === dc) setStatus("disconnected", "idle");
  };
  dc.onmessage = (e) => onServerMessage(e.data);
  const ready = new Promise((resolve, reject) => {
    state.readyWaiters.push({ resolve, reject });
    setTimeout(() => reject(new Error("no session.ready from the server")), SESSION_READY_TIMEOUT_MS);
  });
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);
    const offer = pc.localDescription;
    const answer = await api("POST", "/offer", { sdp: offer.sdp, type: offer.type });
    record("http", "answer", { session_id: answer.session_id });
    state.sessionId = answer.session_id ?? null;
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
    await ready;
  } catch (err) {
    throw connectFailed(err);
  }
  setStatus("connected", "ok");
  return state.sessionId;
}

function connectFailed(err) {
  record("page", "error", { code: "connect", message: String(err.message || err) });
  disconnect();
  setStatus("error", "error");
  return err;
}

function iceGatheringComplete(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => {
      if (pc.iceGatheringState === "complete") done();
    };
    pc.addEventListener("icegatheringstatechange", check);
    // Host candidates are enough on a LAN or loopback; do not wait forever for the rest.
    setTimeout(done, ICE_GATHERING_TIMEOUT_MS);
  });
}

function disconnect() {
  stopStreamers(() => true);
  if (state.dc) state.dc.close();
  if (state.pc) state.pc.close();
  state.dc = null;
  state.pc = null;
  state.sessionId = null;
  for (const w of state.readyWaiters.splice(0)) w.reject(new Error("disconnected"));
  setStatus("disconnected", "idle");
  updateButtons();
}

function send(msg) {
  if (!channelOpen()) throw new Error("not connected");
  state.dc.send(JSON.stringify(msg));
  record("out", msg.type, msg);
}

function onServerMessage(data) {
  let msg;
  try {
    msg = JSON.parse(data);
  } catch {
    record("in", "invalid", { data: String(data).slice(0, 200) });
    return;
  }
  record("in", msg.type || "?", msg);
  const t = now();
  const u = msg.id !== undefined && msg.id !== null ? voiceOut.utterances[msg.id] : undefined;
  switch (msg.type) {
    case "session.ready":
      mark("sessionReady", t);
      state.sessionId = msg.session_id ?? state.sessionId;
      state.sampleRate = msg.sample_rate ?? null;
      if (Array.isArray(msg.voices)) fillVoices(msg.voices);
      for (const w of state.readyWaiters.splice(0)) w.resolve();
      break;
    case "audio.started":
      mark("audioStarted", t);
      if (u) {
        u.startedAt = t;
        u.serverTtfaMs = msg.ttfa_ms;
        if (!TERMINAL.has(u.status)) u.status = "playing";
        onAudioStarted(u);
      }
      $("stat-server-ttfa").textContent = fmtMs(msg.ttfa_ms);
      break;
    case "audio.done":
      if (u) {
        u.audioDoneAt = t;
        u.audioMs = msg.audio_ms;
        u.status = "done";
        $("heard").textContent = u.text;
      }
      break;
    case "cancelled":
      if (u) {
        u.cancelledAt = t;
        u.playedMs = msg.played_ms;
        u.playedText = msg.played_text ?? "";
        u.status = "cancelled";
      }
      $("heard").textContent = `${msg.played_text ?? ""} …`;
      break;
    case "error":
      if (u) {
        u.error = msg.code;
        // Some errors refuse one delta and the utterance goes on (text_too_long, ...); these
        // mean it never started or has ended. Either way, stop streaming text into it.
        if (ERRORS_ENDING_UTTERANCE.has(msg.code) && !TERMINAL.has(u.status)) u.status = "error";
        stopStreamers((s) => s.id === u.id);
      }
      break;
    case "pong":
      if (typeof msg.t === "number") $("stat-rtt").textContent = fmtMs(t - msg.t);
      break;
    default:
      break;
  }
}

function ping() {
  send({ type: "ping", t: now() });
}

// ---------------------------------------------------------------------------------------------
// Utterances

/** Speech tokens of the first chunk when "fast start" is on (docs/protocol.md, fast_first). */
const FAST_FIRST_TOKENS = 12;

function newUtterance(voice, fastFirst = null) {
  const id = `u${state.nextId++}`;
  voiceOut.utterances[id] = {
    id,
    voice: voice || null,
    fastFirst, // speech tokens of a fast first chunk, or null: the server's default
    text: "",
    status: "sending", // sending -> sent -> playing -> done | cancelled | error
    firstDeltaAt: null,
    doneSentAt: null,
    startedAt: null, // audio.started received
    serverTtfaMs: null,
    firstAudibleAt: null, // first audible block in the page
    pageTtfaMs: null, // firstAudibleAt - firstDeltaAt
    audioDoneAt: null,
    audioMs: null,
    cancelSentAt: null,
    cancelledAt: null,
    playedMs: null,
    playedText: null,
    error: null,
  };
  state.utteranceOrder.push(id);
  return id;
}

function sendDelta(id, delta) {
  const u = voiceOut.utterances[id];
  const msg = { type: "text.delta", id, delta };
  if (u.firstDeltaAt === null && u.voice) msg.voice = u.voice;
  if (u.firstDeltaAt === null && u.fastFirst !== null) msg.fast_first = u.fastFirst;
  send(msg);
  if (u.firstDeltaAt === null) u.firstDeltaAt = mark("firstDeltaSent");
  u.text += delta;
}

function sendDone(id) {
  send({ type: "text.done", id });
  const u = voiceOut.utterances[id];
  u.doneSentAt = now();
  if (u.status === "sending") u.status = "sent";
}

function selectedVoice() {
  return $("voice").value || null;
}

function selectedFastFirst() {
  return $("fast-start").checked ? FAST_FIRST_TOKENS : null;
}

/**
 * Speak a whole text at once: one delta (or, with `deltaChars`, deltas of that many characters
 * sent back to back), then done. Returns the utterance id.
 */
function speak(text, { voice = selectedVoice(), fastFirst = selectedFastFirst(), deltaChars = 0 } = {}) {
  if (!text.trim()) return null;
  const id = newUtterance(voice, fastFirst);
  const step = deltaChars > 0 ? deltaChars : text.length;
  for (let i = 0; i < text.length; i += step) sendDelta(id, text.slice(i, i + step));
  sendDone(id);
  return id;
}

/** Split text into word-ish deltas like an LLM's tokens: " word", long words in pieces. */
function splitIntoDeltas(text) {
  const deltas = [];
  for (const word of text.match(/\s*\S+/g) || []) {
    let rest = word;
    while (rest.trimStart().length > 8) {
      const cut = rest.length - rest.trimStart().length + 4;
      deltas.push(rest.slice(0, cut));
      rest = rest.slice(cut);
    }
    deltas.push(rest);
  }
  return deltas;
}

/** Stream text at `tps` deltas per second, then text.done. Returns the id at once. */
function startStream(text, { tps = 20, voice = selectedVoice(), fastFirst = selectedFastFirst() } = {}) {
  const deltas = splitIntoDeltas(text);
  if (deltas.length === 0) return null;
  const id = newUtterance(voice, fastFirst);
  const streamer = { id, stopped: false };
  state.streamers.add(streamer);
  const interval = 1000 / Math.max(0.1, tps);
  (async () => {
    const start = now();
    try {
      for (let i = 0; i < deltas.length && !streamer.stopped; i++) {
        const wait = start + i * interval - now();
        if (wait > 0) await sleep(wait);
        if (!streamer.stopped) sendDelta(id, deltas[i]);
      }
      if (!streamer.stopped) sendDone(id);
    } catch (err) {
      record("page", "error", { id, code: "stream", message: String(err.message || err) });
    } finally {
      state.streamers.delete(streamer);
    }
  })();
  return id;
}

function stopStreamers(predicate) {
  for (const s of state.streamers) if (predicate(s)) s.stopped = true;
}

/** Barge-in: {"type":"cancel"} (everything) or {"type":"cancel","id"} (id and all after it). */
function cancel(id = null, reason = "button") {
  const at = now();
  const index = id ? state.utteranceOrder.indexOf(id) : 0;
  const ids = state.utteranceOrder
    .slice(Math.max(0, index))
    .filter((x) => !TERMINAL.has(voiceOut.utterances[x].status));
  stopStreamers((s) => ids.includes(s.id));
  send(id ? { type: "cancel", id } : { type: "cancel" });
  mark("cancelSent", at);
  for (const x of ids) voiceOut.utterances[x].cancelSentAt = at;
  const bargeIn = { at, reason, ids, lastAudibleAt: null, silenceAt: null, ms: null };
  voiceOut.bargeIns.push(bargeIn);
  state.pendingCancels.push(bargeIn);
  return bargeIn;
}

/** An utterance is under way and not yet cut (the sound of a cut one may still be draining). */
function speaking() {
  return state.utteranceOrder.some((id) => {
    const u = voiceOut.utterances[id];
    return !TERMINAL.has(u.status) && u.cancelSentAt === null;
  });
}

// ---------------------------------------------------------------------------------------------
// Microphone barge-in: a simple energy VAD on the microphone.

async function setMicBargeIn(on) {
  $("mic-barge-in").checked = on;
  if (!on) {
    if (state.mic) {
      clearInterval(state.mic.timer);
      for (const track of state.mic.stream.getTracks()) track.stop();
      state.mic = null;
    }
    $("mic-level").value = 0;
    return;
  }
  if (state.mic) return;
  const ctx = await ensureAudio();
  const stream = await navigator.mediaDevices.getUserMedia({
    // Echo cancellation keeps the agent's own voice from interrupting itself.
    audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: false },
  });
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 1024;
  ctx.createMediaStreamSource(stream).connect(analyser);
  const buf = new Float32Array(analyser.fftSize);
  const mic = { stream, analyser, speechMs: 0, timer: 0 };
  mic.timer = setInterval(() => {
    analyser.getFloatTimeDomainData(buf);
    let sum = 0;
    for (const x of buf) sum += x * x;
    const rms = Math.sqrt(sum / buf.length);
    $("mic-level").value = rms;
    mic.speechMs = rms >= Number($("mic-threshold").value) ? mic.speechMs + MIC_POLL_MS : 0;
    if (mic.speechMs >= voiceOut.micVad.speechMs && channelOpen() && speaking()) {
      mic.speechMs = 0;
      mark("micBargeIn");
      record("page", "mic", { rms: Number(rms.toFixed(4)), note: "speech detected, barging in" });
      cancel(null, "microphone");
    }
  }, MIC_POLL_MS);
  state.mic = mic;
}

// ---------------------------------------------------------------------------------------------
// Voices

function voiceName(v) {
  return typeof v === "string" ? v : v.name || v.id || "?";
}

/**
 * Fill the voice menu. "server default" is offered only when the server has a default voice;
 * otherwise (or when that is not known) a registered voice is selected, so that Speak works
 * on the first click instead of answering no_voice.
 */
function fillVoices(list) {
  const select = $("voice");
  const keep = select.value;
  const names = list.map(voiceName);
  select.replaceChildren();
  if (state.defaultVoice) select.add(new Option(`server default (${state.defaultVoice})`, ""));
  for (const name of names) select.add(new Option(name, name));
  if (!state.defaultVoice && !names.length) select.add(new Option("no voices yet: add one", ""));
  const keepable = [...select.options].some((o) => o.value === keep);
  select.value = keepable ? keep : state.defaultVoice || !names.length ? "" : names[0];
}

async function listVoices() {
  const data = await api("GET", "/voices");
  const list = Array.isArray(data) ? data : data?.voices || [];
  if (data && !Array.isArray(data) && "default_voice" in data) state.defaultVoice = data.default_voice;
  fillVoices(list);
  record("http", "voices", { voices: list.map(voiceName) });
  return list.map(voiceName);
}

/** POST /voices. `audioBlob` null: the last recording. Selects the new voice. */
async function uploadVoice(name, audioBlob, transcript, filename = "prompt.wav") {
  audioBlob = audioBlob || state.recordedWav;
  if (!audioBlob) throw new Error("no audio: choose a file or record one");
  const form = new FormData();
  form.append("name", name);
  form.append("transcript", transcript);
  form.append("audio", audioBlob, filename);
  const data = await api("POST", "/voices", form);
  record("http", "voice added", { name });
  await listVoices();
  $("voice").value = name;
  return data;
}

async function deleteVoice(name) {
  await api("DELETE", `/voices/${encodeURIComponent(name)}`);
  record("http", "voice deleted", { name });
  await listVoices();
}

async function toggleRecording() {
  if (state.recorder) stopRecording();
  else await startRecording();
}

/**
 * Record from the microphone until stopRecording(). Resolves, once recording has started, to
 * {finished}: a promise of the WAV blob, settled when it stops. The WAV is also kept in
 * state.recordedWav for "Register voice".
 */
async function startRecording() {
  const button = $("record");
  await ensureAudio();
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { echoCancellation: false, noiseSuppression: false, autoGainControl: true },
  });
  const recorder = new MediaRecorder(stream);
  const chunks = [];
  const started = now();
  const timer = setInterval(() => {
    $("record-status").textContent = `recording… ${((now() - started) / 1000).toFixed(1)} s`;
  }, 100);
  const finished = new Promise((resolve, reject) => {
    recorder.ondataavailable = (e) => chunks.push(e.data);
    recorder.onstop = async () => {
      clearInterval(timer);
      for (const track of stream.getTracks()) track.stop();
      state.recorder = null;
      button.textContent = "Record with microphone";
      button.classList.remove("recording");
      try {
        const wav = await toWav(new Blob(chunks, { type: recorder.mimeType }));
        state.recordedWav = wav;
        const preview = $("recording-preview");
        preview.src = URL.createObjectURL(wav);
        preview.hidden = false;
        $("record-status").textContent = `recorded ${((now() - started) / 1000).toFixed(1)} s; type its transcript`;
        resolve(wav);
      } catch (err) {
        $("record-status").textContent = `could not decode the recording: ${err}`;
        reject(err);
      }
    };
  });
  state.recorder = recorder;
  recorder.start();
  button.textContent = "Stop recording";
  button.classList.add("recording");
  return { finished };
}

function stopRecording() {
  if (state.recorder && state.recorder.state !== "inactive") state.recorder.stop();
}

/** Record `ms` of microphone audio; returns the WAV's size and duration (for tests). */
async function recordFor(ms) {
  const { finished } = await startRecording();
  await sleep(ms);
  stopRecording();
  const wav = await finished;
  return { bytes: wav.size, seconds: (wav.size - 44) / 2 / state.audioCtx.sampleRate };
}

/** Decode a recording (webm/ogg) and re-encode it as 16-bit mono WAV, which any server reads. */
async function toWav(blob) {
  const decoded = await state.audioCtx.decodeAudioData(await blob.arrayBuffer());
  const n = decoded.length;
  const mono = new Float32Array(n);
  for (let c = 0; c < decoded.numberOfChannels; c++) {
    const data = decoded.getChannelData(c);
    for (let i = 0; i < n; i++) mono[i] += data[i] / decoded.numberOfChannels;
  }
  const view = new DataView(new ArrayBuffer(44 + n * 2));
  const text = (offset, s) => [...s].forEach((ch, i) => view.setUint8(offset + i, ch.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + n * 2, true);
  text(8, "WAVE");
  text(12, "fmt ");
  view.setUint32(16, 16, true); // PCM header size
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, decoded.sampleRate, true);
  view.setUint32(28, decoded.sampleRate * 2, true); // bytes per second
  view.setUint16(32, 2, true); // bytes per frame
  view.setUint16(34, 16, true); // bits per sample
  text(36, "data");
  view.setUint32(40, n * 2, true);
  for (let i = 0; i < n; i++) view.setInt16(44 + i * 2, Math.max(-1, Math.min(1, mono[i])) * 0x7fff, true);
  return new Blob([view], { type: "audio/wav" });
}

// ---------------------------------------------------------------------------------------------
// Wiring

function reportError(err) {
  record("page", "error", { code: "page", message: String(err.message || err) });
}

function guarded(fn) {
  return () => Promise.resolve().then(fn).catch(reportError);
}

function wire() {
  $("connect").addEventListener(
    "click",
    guarded(async () => {
      if (state.pc) disconnect();
      else {
        await connect();
        await listVoices().catch(reportError);
      }
    }),
  );
  $("speak").addEventListener("click", guarded(() => speak($("text").value)));
  $("stream").addEventListener("click", guarded(() => startStream($("text").value, { tps: Number($("tps").value) || 20 })));
  $("cancel").addEventListener("click", guarded(() => cancel(null, "button")));
  $("ping").addEventListener("click", guarded(ping));
  $("clear-log").addEventListener("click", () => $("log").replaceChildren());
  $("show-deltas").addEventListener("change", (e) => $("log").classList.toggle("hide-deltas", !e.target.checked));
  $("refresh-voices").addEventListener("click", guarded(listVoices));
  $("delete-voice").addEventListener(
    "click",
    guarded(async () => {
      const name = selectedVoice();
      if (name && confirm(`Remove the voice "${name}"?`)) await deleteVoice(name);
    }),
  );
  $("mic-barge-in").addEventListener("change", (e) => {
    setMicBargeIn(e.target.checked).catch((err) => {
      e.target.checked = false;
      reportError(err);
    });
  });
  $("record").addEventListener("click", guarded(toggleRecording));
  $("upload-voice").addEventListener(
    "click",
    guarded(async () => {
      const name = $("new-voice-name").value.trim();
      const transcript = $("new-voice-transcript").value.trim();
      const file = $("new-voice-file").files[0];
      const audioBlob = file || state.recordedWav;
      if (!name || !transcript || !audioBlob) throw new Error("a voice needs a name, a transcript and audio");
      await uploadVoice(name, audioBlob, transcript, file ? file.name : "recording.wav");
      $("new-voice-file").value = "";
    }),
  );
  window.addEventListener("keydown", (e) => {
    // Escape: barge in, like talking over the agent.
    if (e.key === "Escape" && channelOpen()) guarded(() => cancel(null, "escape key"))();
  });
  updateButtons();
  setStatus("disconnected", "idle");
}

wire();
listVoices().catch(() => {}); // fill the list early when the server allows it
voiceOut.loaded = true;
