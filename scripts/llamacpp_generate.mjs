// Greedy continuation of a prompt by llama.cpp (through node-llama-cpp's
// prebuilt binary), for scripts/llamacpp_check.sh: the model's BOS, then the
// prompt as llama.cpp tokenizes it, then up to N tokens at temperature 0,
// stopping at end of text. Prints the prompt's ids on stderr and the
// continuation's ids on stdout, as JSON (the check spells them from the
// file's own vocabulary: llama.cpp's detokenizer would drop the space in
// " ." and the like).
import {getLlama} from "node-llama-cpp";

const [modelPath, prompt, n] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: 256, threads: 2});
const sequence = context.getSequence();
const ids = [model.tokens.bos, ...model.tokenize(prompt, false)];
process.stderr.write(`llama.cpp prompt ids ${JSON.stringify(ids)}\n`);
const out = [];
for await (const t of sequence.evaluate(ids, {temperature: 0})) {
  if (model.isEogToken(t) || out.length >= Number(n)) break;
  out.push(t);
}
process.stdout.write(JSON.stringify(out) + "\n");
