//! `config.json` of a reference FoX checkpoint (spec §1), read by serde into [`RawConfig`]
//! (every error names its field) and then checked value by value. Unsupported values are
//! errors, never silently ignored; fields this engine does not read are ignored.

use crate::error::{Error, Result};
use serde::Deserialize;
use serde_json::Value;

/// MLP activation (`hidden_act`): `h += (act(g) ⊙ u)·Wdᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenAct {
    /// `"swish"` (alias `"silu"`): act(g) = g·sigmoid(g).
    Swish,
    /// `"sigmoid"`: act(g) = sigmoid(g).
    Sigmoid,
}

/// Output-gate nonlinearity (`ogate_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OgateAct {
    Sigmoid,
    Silu,
}

/// The architecture fields of a FoX checkpoint that affect the forward math.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// V: vocabulary size (tokens).
    pub vocab_size: usize,
    /// D: residual width.
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// H: attention heads; head_dim = D / H.
    pub num_heads: usize,
    /// I: MLP width (resolved from `hidden_ratio` when the file has null).
    pub intermediate_size: usize,
    pub hidden_act: HiddenAct,
    /// eps of attn_norm, mlp_norm, the final norm and output_norm.
    pub norm_eps: f64,
    pub qk_norm: bool,
    pub qk_norm_share_param_across_head: bool,
    pub use_k_shift: bool,
    pub use_v_shift: bool,
    pub use_output_gate: bool,
    pub ogate_act: OgateAct,
    pub use_output_norm: bool,
    pub tie_word_embeddings: bool,
    /// ln eps for ACP from the file (None = ACP off); sessions may override it.
    pub log_pruning_tolerance: Option<f64>,
}

/// eps of the QK-norm (GroupRMSNorm built with its default eps, spec §3 step 4).
pub const QK_NORM_EPS: f64 = 1e-5;

fn bad(field: &str, message: impl Into<String>) -> Error {
    Error::bad_model(format!("config.json: field `{field}`"), message)
}

fn unsupported(field: &str, message: impl std::fmt::Display) -> Error {
    Error::Unsupported(format!("config.json: field `{field}`: {message}"))
}

/// `config.json` as written, one field per key this engine reads (spec §1). `Option` fields
/// may be absent or null (serde reads a missing `Option` as `None`). Numbers are finite
/// (JSON has no NaN or infinity).
#[derive(Debug, Deserialize)]
struct RawConfig {
    vocab_size: u64,
    hidden_size: u64,
    num_hidden_layers: u64,
    num_heads: u64,
    hidden_ratio: Option<f64>,
    intermediate_size: Option<u64>,
    hidden_act: String,
    norm_eps: Option<f64>,
    qk_norm: bool,
    qk_norm_share_param_across_head: Option<bool>,
    use_k_shift: bool,
    use_v_shift: bool,
    use_output_gate: bool,
    ogate_act: Option<String>,
    use_output_norm: bool,
    fgate_type: String,
    use_rope: Option<bool>,
    /// Must be absent or null (no GQA, no sliding window in this engine).
    num_kv_heads: Option<Value>,
    window_size: Option<Value>,
    tie_word_embeddings: Option<bool>,
    log_pruning_tolerance: Option<f64>,
}

/// A positive integer that also fits the engine's index arithmetic (< 2^31).
fn positive(field: &str, n: u64) -> Result<usize> {
    if n == 0 || n >= 1 << 31 {
        return Err(bad(field, format!("{n} is out of range 1..2^31")));
    }
    Ok(n as usize)
}

/// A field that may be absent or null; anything else is unsupported.
fn must_be_null(field: &str, v: &Option<Value>) -> Result<()> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(v) => Err(unsupported(field, format!("{v} (must be null)"))),
    }
}

/// Reads `text` into [`RawConfig`]: invalid JSON, a top level that is not an object, a
/// missing field or a value of the wrong type are [`Error::BadModel`] errors naming the field.
fn parse_raw(text: &str) -> Result<RawConfig> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| Error::bad_model("config.json", format!("invalid JSON: {e}")))?;
    if !value.is_object() {
        return Err(Error::bad_model(
            "config.json",
            "top level is not a JSON object",
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let field = e.path().to_string();
        let message = e.inner().to_string();
        match message.strip_prefix("missing field `") {
            Some(rest) => bad(rest.trim_end_matches('`'), "missing"),
            None => bad(&field, message),
        }
    })
}

/// `intermediate_size` when the file has null (spec §1): `int(D · ratio · 2 / 3)` evaluated
/// left to right in f64 and truncated, rounded up to a multiple of 256; ratio null → 4.
pub fn resolve_intermediate_size(hidden_size: usize, hidden_ratio: Option<f64>) -> usize {
    let ratio = hidden_ratio.unwrap_or(4.0);
    let i = (hidden_size as f64 * ratio * 2.0 / 3.0) as usize;
    i.div_ceil(256) * 256
}

impl Config {
    /// Parses and validates the text of `config.json`.
    pub fn from_json(text: &str) -> Result<Config> {
        let raw = parse_raw(text)?;
        let vocab_size = positive("vocab_size", raw.vocab_size)?;
        let hidden_size = positive("hidden_size", raw.hidden_size)?;
        let num_hidden_layers = positive("num_hidden_layers", raw.num_hidden_layers)?;
        let num_heads = positive("num_heads", raw.num_heads)?;
        if hidden_size % num_heads != 0 {
            return Err(bad(
                "num_heads",
                format!("hidden_size {hidden_size} is not a multiple of num_heads {num_heads}"),
            ));
        }
        let head_dim = hidden_size / num_heads;
        if head_dim % 8 != 0 {
            return Err(unsupported(
                "num_heads",
                format!("head_dim {head_dim} is not a multiple of 8"),
            ));
        }

        let hidden_ratio = raw.hidden_ratio;
        if let Some(r) = hidden_ratio
            && r <= 0.0
        {
            return Err(bad("hidden_ratio", format!("{r} must be > 0")));
        }
        let intermediate_size = match raw.intermediate_size {
            None => {
                let i = resolve_intermediate_size(hidden_size, hidden_ratio);
                if i == 0 || i >= 1 << 31 {
                    return Err(bad("hidden_ratio", format!("gives MLP width {i}")));
                }
                i
            }
            Some(n) => positive("intermediate_size", n)?,
        };

        let hidden_act = match raw.hidden_act.as_str() {
            "swish" | "silu" => HiddenAct::Swish,
            "sigmoid" => HiddenAct::Sigmoid,
            other => return Err(unsupported("hidden_act", format!("\"{other}\""))),
        };
        let norm_eps = raw.norm_eps.ok_or_else(|| bad("norm_eps", "missing"))?;
        if norm_eps <= 0.0 {
            return Err(bad("norm_eps", format!("{norm_eps} must be > 0")));
        }

        let ogate_act = match raw.ogate_act.as_deref() {
            None | Some("sigmoid") => OgateAct::Sigmoid,
            Some("silu" | "swish") => OgateAct::Silu,
            Some(other) => return Err(unsupported("ogate_act", format!("\"{other}\""))),
        };
        if raw.use_output_gate && raw.use_output_norm && ogate_act != OgateAct::Sigmoid {
            return Err(unsupported(
                "ogate_act",
                "with use_output_norm only the sigmoid output gate exists",
            ));
        }
        if raw.fgate_type != "full" {
            return Err(unsupported(
                "fgate_type",
                format!("\"{}\" (only \"full\" is implemented)", raw.fgate_type),
            ));
        }
        if raw.use_rope == Some(true) {
            return Err(unsupported(
                "use_rope",
                "rotary embeddings are not part of FoX",
            ));
        }
        must_be_null("num_kv_heads", &raw.num_kv_heads)?;
        must_be_null("window_size", &raw.window_size)?;
        let log_pruning_tolerance = raw.log_pruning_tolerance;
        if let Some(x) = log_pruning_tolerance
            && x > 0.0
        {
            return Err(bad(
                "log_pruning_tolerance",
                format!("ln eps {x} must be <= 0"),
            ));
        }

        Ok(Config {
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_heads,
            intermediate_size,
            hidden_act,
            norm_eps,
            qk_norm: raw.qk_norm,
            qk_norm_share_param_across_head: raw.qk_norm_share_param_across_head.unwrap_or(false),
            use_k_shift: raw.use_k_shift,
            use_v_shift: raw.use_v_shift,
            use_output_gate: raw.use_output_gate,
            ogate_act,
            use_output_norm: raw.use_output_norm,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            log_pruning_tolerance,
        })
    }

    /// Head width `hd = D / H`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intermediate_size_rule() {
        assert_eq!(resolve_intermediate_size(256, Some(3.5)), 768);
        assert_eq!(resolve_intermediate_size(256, None), 768);
        assert_eq!(resolve_intermediate_size(1024, Some(3.5)), 2560);
        assert_eq!(resolve_intermediate_size(768, None), 2048);
    }

    const BUNDLED: &str = include_str!("../models/fox-tiny-pro/config.json");

    /// The bundled config with `"key": value` replaced (the key must be in it).
    fn with(key: &str, value: &str) -> String {
        let at = BUNDLED
            .find(&format!("\"{key}\":"))
            .expect("key in the config");
        let start = at + key.len() + 3;
        let end = start + BUNDLED[start..].find([',', '\n']).expect("value ends");
        format!("{}{value}{}", &BUNDLED[..start], &BUNDLED[end..])
    }

    #[test]
    fn the_bundled_config_reads_and_extra_fields_are_ignored() {
        let c = Config::from_json(BUNDLED).unwrap();
        assert_eq!(
            (c.vocab_size, c.hidden_size, c.intermediate_size),
            (256, 256, 768)
        );
        assert_eq!((c.num_hidden_layers, c.num_heads, c.head_dim()), (4, 4, 64));
        assert_eq!(c.hidden_act, HiddenAct::Swish);
        assert_eq!(c.ogate_act, OgateAct::Sigmoid);
        assert!(c.qk_norm && c.use_output_gate && c.use_output_norm);
        assert_eq!(c.log_pruning_tolerance, None);
        let extra = BUNDLED.replacen('{', "{\"something_new\": [1, {\"a\": null}],", 1);
        assert_eq!(Config::from_json(&extra).unwrap(), c);
        // Optional fields may be absent.
        let mut lean = BUNDLED.to_string();
        for key in [
            "ogate_act",
            "use_rope",
            "num_kv_heads",
            "window_size",
            "tie_word_embeddings",
        ] {
            lean = lean.replacen(&format!("\"{key}\":"), &format!("\"unused_{key}\":"), 1);
        }
        assert_eq!(Config::from_json(&lean).unwrap(), c);
    }

    /// A value of the wrong type, or a missing required field, is a bad-model error naming
    /// the field, for every field the engine reads.
    #[test]
    fn every_field_is_named_in_its_errors() {
        let fields = [
            ("vocab_size", true),
            ("hidden_size", true),
            ("num_hidden_layers", true),
            ("num_heads", true),
            ("hidden_ratio", false),
            ("intermediate_size", false),
            ("hidden_act", true),
            ("norm_eps", true),
            ("qk_norm", true),
            ("qk_norm_share_param_across_head", false),
            ("use_k_shift", true),
            ("use_v_shift", true),
            ("use_output_gate", true),
            ("ogate_act", false),
            ("use_output_norm", true),
            ("fgate_type", true),
            ("use_rope", false),
            ("tie_word_embeddings", false),
            ("log_pruning_tolerance", false),
        ];
        for (key, required) in fields {
            let wrong = if key.ends_with("_act") || key == "fgate_type" {
                "[1]"
            } else {
                "\"x\""
            };
            let e = Config::from_json(&with(key, wrong)).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::BadModel, "{key}: {e}");
            assert!(
                e.to_string().contains(&format!("field `{key}`")),
                "{key}: {e}"
            );
            let gone = BUNDLED.replacen(&format!("\"{key}\":"), "\"renamed\":", 1);
            match Config::from_json(&gone) {
                Err(e) => {
                    assert!(required, "{key}: {e}");
                    assert_eq!(
                        e.to_string(),
                        format!("bad model file: config.json: field `{key}`: missing")
                    );
                }
                Ok(_) => assert!(!required, "{key} is required"),
            }
        }
    }
}
