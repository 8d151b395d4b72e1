// Encode text files with a Hugging Face tokenizer.json through @lenml/tokenizers
// (transformers.js's tokenizers, without the models), for scripts/hf_tokenizers_check.sh.
//   node hf_tokenizers_encode.cjs tokenizer.json tokenizer_config.json FILE...
// prints one JSON array of ids per file, without special tokens added.
const fs = require("fs");
const { TokenizerLoader } = require("@lenml/tokenizers");
const [json, config, ...files] = process.argv.slice(2);
const tok = TokenizerLoader.fromPreTrained({
  tokenizerJSON: JSON.parse(fs.readFileSync(json, "utf8")),
  tokenizerConfig: JSON.parse(fs.readFileSync(config, "utf8")),
});
for (const f of files) console.log(JSON.stringify(tok.encode(fs.readFileSync(f, "utf8"), { add_special_tokens: false })));
