//! `foxedge tokenize` and `foxedge detokenize`: text to token ids and back with the model
//! directory's tokenizer.

use super::ModelArg;
use super::generate::read_text;
use clap::{ArgGroup, Args};
use foxedge::{Error, Model, Result, Tokenizer};
use std::io::Write;
use std::path::PathBuf;

/// Print the token ids of a text as one JSON array
///
/// Uses the model directory's tokenizer (tokenizer.json, or vocab.json + merges.txt with
/// tokenizer_config.json; a vocabulary of 256 without files: one token per byte). BOS is
/// prepended when the tokenizer's configuration says so (add_bos_token), unless --no-bos.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("input").required(true).args(["text", "file"])))]
pub struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The text
    #[arg(long, value_name = "TEXT")]
    text: Option<String>,
    /// Read the text from a file (UTF-8)
    #[arg(long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// Do not prepend BOS (the text continues an earlier one)
    #[arg(long)]
    no_bos: bool,
}

/// Print the text of token ids
///
/// Uses the model directory's tokenizer; prints the text exactly, with no newline added.
/// Special tokens (BOS, EOS, ...) print as their text unless --skip-special.
#[derive(Debug, Args)]
pub struct DetokenizeArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Token ids separated by commas or spaces; a JSON array as `tokenize` prints it also
    /// works
    #[arg(long, value_name = "IDS", allow_hyphen_values = true)]
    ids: String,
    /// Leave out special tokens
    #[arg(long)]
    skip_special: bool,
}

/// The tokenizer of the model directory `--model` names.
fn tokenizer(m: &ModelArg) -> Result<Tokenizer> {
    let model = Model::open(m.dir()?)?;
    Ok(model.tokenizer()?.clone())
}

pub fn run_tokenize(a: TokenizeArgs) -> Result<()> {
    let text = match (&a.text, &a.file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => read_text(f)?,
        (None, None) => return Err(Error::InvalidArgument("--text or --file is needed".into())),
    };
    let ids = tokenizer(&a.model)?.encode(&text, !a.no_bos)?;
    let json = serde_json::to_string(&ids)
        .map_err(|e| Error::Internal(format!("cannot write the ids as JSON: {e}")))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{json}").ok();
    Ok(())
}

pub fn run_detokenize(a: DetokenizeArgs) -> Result<()> {
    let ids = parse_ids(&a.ids)?;
    let text = tokenizer(&a.model)?.decode(&ids, a.skip_special)?;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).ok();
    out.flush().ok();
    Ok(())
}

/// Parses `1,2,3`, `1 2 3` or `[1, 2, 3]` into ids; the error names the item at fault.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let t = s.trim();
    let t = t
        .strip_prefix('[')
        .and_then(|x| x.strip_suffix(']'))
        .unwrap_or(t);
    t.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|x| !x.is_empty())
        .enumerate()
        .map(|(i, x)| {
            x.parse::<u32>().map_err(|_| {
                Error::InvalidArgument(format!(
                    "--ids: item {i} `{x}` is not a token id (an integer 0..4294967295)"
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::parse_ids;

    #[test]
    fn ids_in_the_forms_tokenize_prints_and_by_hand() {
        assert_eq!(parse_ids("1,2,3").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_ids("[50256, 15496]").unwrap(), vec![50256, 15496]);
        assert_eq!(parse_ids(" 7 8\n9 ").unwrap(), vec![7, 8, 9]);
        assert_eq!(parse_ids("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_ids("[]").unwrap(), Vec::<u32>::new());
        for (bad, item) in [
            ("1,x", "item 1 `x`"),
            ("-1", "item 0 `-1`"),
            ("1.5", "`1.5`"),
        ] {
            let e = parse_ids(bad).unwrap_err().to_string();
            assert!(e.contains(item), "{e}");
        }
    }
}
