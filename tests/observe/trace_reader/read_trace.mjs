// Load a Trace Event Format file with Chrome DevTools' trace engine (the code its Performance panel opens traces
// with) and print, as JSON, what it made of it: each process's name, and each thread's slices as the engine nested
// them (depth and parent), so that tests check the trace as a real reader sees it, not as h5feed wrote it.
//   node read_trace.mjs TRACE.json
import fs from 'node:fs';
import * as Trace from '@paulirish/trace_engine';

globalThis.DOMRect ??= class DOMRect {  // the engine's one browser global (its README says to provide it in Node)
  constructor(x = 0, y = 0, width = 0, height = 0) { Object.assign(this, {x, y, width, height}); }
};

const file = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const model = Trace.TraceModel.Model.createWithAllHandlers();
await model.parse(file.traceEvents);
const {data} = model.parsedTrace();
const processes = Object.fromEntries([...data.Meta.processNames].map(([pid, event]) => [pid, event.args.name]));
const threads = [];
for (const [pid, process] of data.Renderer.processes) {
  for (const [tid, thread] of process.threads) {
    const nodes = data.Renderer.entryToNode;
    const index = new Map(thread.entries.map((entry, i) => [entry, i]));
    threads.push({
      pid, tid,
      slices: thread.entries.map(entry => {
        const node = nodes.get(entry);  // none: the engine left the slice out of the thread's tree
        return {name: entry.name, ts: entry.ts, dur: entry.dur ?? null, args: entry.args ?? {},
                depth: node ? node.depth : null, parent: node?.parent ? index.get(node.parent.entry) : null,
                in_tree: Boolean(node)};
      }),
    });
  }
}
const marks = file.traceEvents.length;  // every event the file holds, for the test to account for each
console.log(JSON.stringify({generic: data.Meta.traceIsGeneric, events: marks, processes, threads}));
