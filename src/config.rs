//! `config.json` of a reference FoX checkpoint (spec §1), parsed field by field so that
//! every error names the field. Unsupported values are errors, never silently ignored.

use crate::error::{Error, Result};
use serde_json::{Map, Value};

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

fn get<'a>(obj: &'a Map<String, Value>, field: &str) -> Result<&'a Value> {
    obj.get(field).ok_or_else(|| bad(field, "missing"))
}

/// A positive integer that also fits the engine's index arithmetic (< 2^31).
fn positive(obj: &Map<String, Value>, field: &str) -> Result<usize> {
    let v = get(obj, field)?;
    let n = v
        .as_u64()
        .ok_or_else(|| bad(field, format!("expected a positive integer, got {v}")))?;
    if n == 0 || n >= 1 << 31 {
        return Err(bad(field, format!("{n} is out of range 1..2^31")));
    }
    Ok(n as usize)
}

fn boolean(obj: &Map<String, Value>, field: &str) -> Result<bool> {
    let v = get(obj, field)?;
    v.as_bool()
        .ok_or_else(|| bad(field, format!("expected true or false, got {v}")))
}

/// A field that may be absent or null; anything else is an error or unsupported.
fn must_be_null(obj: &Map<String, Value>, field: &str) -> Result<()> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(v) => Err(unsupported(field, format!("{v} (must be null)"))),
    }
}

fn opt_f64(obj: &Map<String, Value>, field: &str) -> Result<Option<f64>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| bad(field, format!("expected a finite number or null, got {v}"))),
    }
}

fn string<'a>(obj: &'a Map<String, Value>, field: &str) -> Result<&'a str> {
    let v = get(obj, field)?;
    v.as_str()
        .ok_or_else(|| bad(field, format!("expected a string, got {v}")))
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
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::bad_model("config.json", format!("invalid JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| Error::bad_model("config.json", "top level is not a JSON object"))?;

        let vocab_size = positive(obj, "vocab_size")?;
        let hidden_size = positive(obj, "hidden_size")?;
        let num_hidden_layers = positive(obj, "num_hidden_layers")?;
        let num_heads = positive(obj, "num_heads")?;
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

        let hidden_ratio = opt_f64(obj, "hidden_ratio")?;
        if let Some(r) = hidden_ratio
            && r <= 0.0
        {
            return Err(bad("hidden_ratio", format!("{r} must be > 0")));
        }
        let intermediate_size = match obj.get("intermediate_size") {
            None | Some(Value::Null) => {
                let i = resolve_intermediate_size(hidden_size, hidden_ratio);
                if i == 0 || i >= 1 << 31 {
                    return Err(bad("hidden_ratio", format!("gives MLP width {i}")));
                }
                i
            }
            Some(_) => positive(obj, "intermediate_size")?,
        };

        let hidden_act = match string(obj, "hidden_act")? {
            "swish" | "silu" => HiddenAct::Swish,
            "sigmoid" => HiddenAct::Sigmoid,
            other => return Err(unsupported("hidden_act", format!("\"{other}\""))),
        };
        let norm_eps = opt_f64(obj, "norm_eps")?.ok_or_else(|| bad("norm_eps", "missing"))?;
        if norm_eps <= 0.0 {
            return Err(bad("norm_eps", format!("{norm_eps} must be > 0")));
        }

        let qk_norm = boolean(obj, "qk_norm")?;
        let qk_norm_share_param_across_head = match obj.get("qk_norm_share_param_across_head") {
            None | Some(Value::Null) => false,
            Some(_) => boolean(obj, "qk_norm_share_param_across_head")?,
        };
        let use_k_shift = boolean(obj, "use_k_shift")?;
        let use_v_shift = boolean(obj, "use_v_shift")?;
        let use_output_gate = boolean(obj, "use_output_gate")?;
        let use_output_norm = boolean(obj, "use_output_norm")?;
        let ogate_act = match obj.get("ogate_act") {
            None | Some(Value::Null) => OgateAct::Sigmoid,
            Some(_) => match string(obj, "ogate_act")? {
                "sigmoid" => OgateAct::Sigmoid,
                "silu" | "swish" => OgateAct::Silu,
                other => return Err(unsupported("ogate_act", format!("\"{other}\""))),
            },
        };
        if use_output_gate && use_output_norm && ogate_act != OgateAct::Sigmoid {
            return Err(unsupported(
                "ogate_act",
                "with use_output_norm only the sigmoid output gate exists",
            ));
        }

        match string(obj, "fgate_type")? {
            "full" => {}
            other => {
                return Err(unsupported(
                    "fgate_type",
                    format!("\"{other}\" (only \"full\" is implemented)"),
                ));
            }
        }
        match obj.get("use_rope") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => {
                return Err(unsupported(
                    "use_rope",
                    "rotary embeddings are not part of FoX",
                ));
            }
            Some(v) => return Err(bad("use_rope", format!("expected a boolean, got {v}"))),
        }
        must_be_null(obj, "num_kv_heads")?;
        must_be_null(obj, "window_size")?;
        let tie_word_embeddings = match obj.get("tie_word_embeddings") {
            None | Some(Value::Null) => false,
            Some(_) => boolean(obj, "tie_word_embeddings")?,
        };
        let log_pruning_tolerance = opt_f64(obj, "log_pruning_tolerance")?;
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
            qk_norm,
            qk_norm_share_param_across_head,
            use_k_shift,
            use_v_shift,
            use_output_gate,
            ogate_act,
            use_output_norm,
            tie_word_embeddings,
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
}
