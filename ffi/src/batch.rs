//! Several sessions in one step: `fx_session_feed_batch`.

use facade::Session;

use crate::abi::check_buf;
use crate::session::fx_session;
use crate::status::{fail, fx_status, fx_status::*, guard, invalid, map_facade};

/// Feeds `n_tokens[i]` tokens (`tokens[i]`) to `sessions[i]` for `i < n`, in one step: the
/// model's dense layers run once over every session's rows, attention per session over its
/// own cache (each with its own options, budget and statistics). Sessions may prefill while
/// others decode. When `logits_out` is not NULL it receives `n * vocab_size` floats: row `i`
/// the next-token logits after session `i`'s last token.
///
/// All sessions must be distinct handles of one model, unscored and usable; the call checks
/// this, and every token, before any session changes. A later internal error leaves every
/// session of the batch unusable until `fx_session_reset`.
///
/// # Safety
/// `sessions` must hold `n` pointers, each NULL or a live handle used by no other thread
/// during the call; `tokens` and `n_tokens` `n` values each, `tokens[i]` pointing to
/// `n_tokens[i]` readable int32 values; `logits_out` NULL or `n * vocab_size` writable floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_feed_batch(
    sessions: *const *mut fx_session,
    n: usize,
    tokens: *const *const i32,
    n_tokens: *const usize,
    logits_out: *mut f32,
) -> fx_status {
    guard(|| {
        check_buf(sessions, "sessions")?;
        check_buf(tokens, "tokens")?;
        check_buf(n_tokens, "n_tokens")?;
        if n == 0 {
            return Err(invalid("n is 0: feed at least one session"));
        }
        if n > isize::MAX as usize / size_of::<*const i32>() {
            return Err(invalid(format!("n = {n} sessions cannot be addressed")));
        }
        // SAFETY: non-null and aligned (checked); C contract: n readable values each.
        let (handles, lists, counts) = unsafe {
            (
                std::slice::from_raw_parts(sessions, n),
                std::slice::from_raw_parts(tokens, n),
                std::slice::from_raw_parts(n_tokens, n),
            )
        };
        for (i, &h) in handles.iter().enumerate() {
            if h.is_null() {
                return Err(fail(FX_ERR_NULL_POINTER, format!("sessions[{i}] is NULL")));
            }
            if handles[..i].contains(&h) {
                return Err(invalid(format!("sessions[{i}] repeats an earlier handle")));
            }
        }
        let mut ids: Vec<Vec<u32>> = Vec::new();
        ids.try_reserve_exact(n)
            .map_err(|_| fail(FX_ERR_OUT_OF_MEMORY, format!("{n} token lists")))?;
        for (i, (&p, &c)) in lists.iter().zip(counts).enumerate() {
            check_buf(p, "tokens[i]")?;
            if c == 0 {
                return Err(invalid(format!(
                    "n_tokens[{i}] is 0: feed at least one token"
                )));
            }
            if c > isize::MAX as usize / size_of::<i32>() {
                return Err(invalid(format!("n_tokens[{i}] = {c} cannot be addressed")));
            }
            // SAFETY: non-null and aligned (checked); C contract: c readable int32 values.
            let toks = unsafe { std::slice::from_raw_parts(p, c) };
            let mut v = Vec::new();
            v.try_reserve_exact(c)
                .map_err(|_| fail(FX_ERR_OUT_OF_MEMORY, format!("{c} token ids")))?;
            for (j, &t) in toks.iter().enumerate() {
                v.push(u32::try_from(t).map_err(|_| {
                    invalid(format!("token {t} at index {j} of session {i} is negative"))
                })?);
            }
            ids.push(v);
        }
        let mut handles: Vec<&mut fx_session> = handles
            .iter()
            // SAFETY: non-null (checked), pairwise distinct (checked), and by the C
            // contract live handles used by this thread only: one &mut each.
            .map(|&h| unsafe { &mut *h })
            .collect();
        for (i, h) in handles.iter().enumerate() {
            if h.poisoned {
                return Err(fail(
                    FX_ERR_INTERNAL,
                    format!("sessions[{i}] is unusable after an internal error; reset it"),
                ));
            }
        }
        let vocab = handles[0].session.model().info().vocab;
        let logits = if logits_out.is_null() {
            None
        } else {
            check_buf(logits_out, "logits_out")?;
            let len = n
                .checked_mul(vocab)
                .ok_or_else(|| invalid("n * vocab_size overflows"))?;
            // SAFETY: non-null, aligned (checked); C contract: n * vocab_size writable
            // floats. Tokens were copied out, so aliasing them cannot be observed.
            Some(unsafe { std::slice::from_raw_parts_mut(logits_out, len) })
        };
        let lists: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut ss: Vec<&mut Session> = handles.iter_mut().map(|h| &mut h.session).collect();
            Session::feed_batch(&mut ss, &lists, logits)
        }));
        match r {
            Ok(r) => r.map_err(map_facade),
            Err(payload) => {
                for h in &mut handles {
                    h.poisoned = true;
                }
                std::panic::resume_unwind(payload)
            }
        }
    })
}
