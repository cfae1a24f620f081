// AudioWorklet processor: passes the remote audio through unchanged and reports the level of
// every render quantum (128 frames) to the page, stamped with the audio clock. The page turns
// these reports into "first audible sample" and "silence" moments (see AudibilityDetector in
// app.js); keeping the logic there lets the AnalyserNode fallback share it.

const BLOCKS_PER_REPORT = 4; // ~10 ms at 48 kHz: few messages, fine time resolution
const FIELDS = 4; // start (s), end (s), rms, peak

class LevelMeter extends AudioWorkletProcessor {
  constructor() {
    super();
    this.report = new Float64Array(BLOCKS_PER_REPORT * FIELDS);
    this.count = 0;
  }

  process(inputs, outputs) {
    const input = inputs[0];
    const output = outputs[0];
    const frames = output.length > 0 ? output[0].length : 128;
    let sumSquares = 0;
    let peak = 0;
    if (input.length > 0) {
      for (let c = 0; c < output.length; c++) {
        output[c].set(input[Math.min(c, input.length - 1)]);
      }
      // Level of the first channel: the stream is mono, upmixed identically to every channel.
      const samples = input[0];
      for (let i = 0; i < samples.length; i++) {
        const x = samples[i];
        sumSquares += x * x;
        const a = x < 0 ? -x : x;
        if (a > peak) peak = a;
      }
    }
    // A block with no input (nothing connected yet) still counts: it is silence, and the
    // page's clock must keep moving so that "silence after barge-in" can be decided.
    const offset = this.count * FIELDS;
    this.report[offset] = currentTime;
    this.report[offset + 1] = currentTime + frames / sampleRate;
    this.report[offset + 2] = Math.sqrt(sumSquares / frames);
    this.report[offset + 3] = peak;
    this.count += 1;
    if (this.count === BLOCKS_PER_REPORT) {
      this.port.postMessage(this.report.slice());
      this.count = 0;
    }
    return true;
  }
}

registerProcessor("level-meter", LevelMeter);
