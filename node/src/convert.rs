//! Conversions between the generated proto types and domain types, at the edge and nowhere else
//! (`TryFrom` where the wire can carry nonsense).

use tandem_engine::engine::{FinishReason, SeqOutput, TokenLogprob};
use tandem_engine::sampling::SamplingParams;
use tandem_kv_transfer::{DType, Geometry, GeometrySpec, Layout, TransferDescriptor};
use tandem_proto::node::v1 as node;
use tandem_proto::v1 as api;

use crate::error::NodeError;

/// A peer-supplied string made safe to log: at most 200 bytes, control characters escaped.
pub fn printable(s: &str) -> String {
    let mut end = s.len().min(200);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let mut out: String = s[..end].escape_debug().collect();
    if end < s.len() {
        out.push_str("...");
    }
    out
}

/// Most top logprobs a request may ask for.
pub const MAX_LOGPROBS: u32 = 20;

/// Wire sampling parameters → engine parameters; unset fields take `tandem generate`'s defaults (greedy).
pub fn sampling_from_proto(p: Option<&api::SamplingParams>) -> Result<SamplingParams, NodeError> {
    let mut s = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let Some(p) = p else { return Ok(s) };
    if let Some(v) = p.max_tokens {
        s.max_tokens = v as usize;
    }
    if let Some(v) = p.temperature {
        s.temperature = v;
    }
    if let Some(v) = p.top_p {
        s.top_p = v;
    }
    if let Some(v) = p.top_k {
        s.top_k = v as usize;
    }
    if let Some(v) = p.min_p {
        s.min_p = v;
    }
    if let Some(v) = p.repetition_penalty {
        s.repetition_penalty = v;
    }
    if let Some(v) = p.presence_penalty {
        s.presence_penalty = v;
    }
    if let Some(v) = p.frequency_penalty {
        s.frequency_penalty = v;
    }
    s.seed = p.seed;
    s.stop = p.stop.clone();
    s.stop_token_ids = p.stop_token_ids.clone();
    s.ignore_eos = p.ignore_eos;
    if let Some(n) = p.logprobs {
        if n > MAX_LOGPROBS {
            return Err(NodeError::InvalidArgument(format!("logprobs must be at most {MAX_LOGPROBS}, got {n}")));
        }
        s.logprobs = Some(n as usize);
    }
    s.validate()?;
    Ok(s)
}

/// Engine sampling parameters → wire (what a node forwards to another node).
pub fn sampling_to_proto(s: &SamplingParams) -> api::SamplingParams {
    api::SamplingParams {
        max_tokens: Some(s.max_tokens as u32),
        temperature: Some(s.temperature),
        top_p: Some(s.top_p),
        top_k: Some(s.top_k as u32),
        min_p: Some(s.min_p),
        repetition_penalty: Some(s.repetition_penalty),
        presence_penalty: Some(s.presence_penalty),
        frequency_penalty: Some(s.frequency_penalty),
        seed: s.seed,
        stop: s.stop.clone(),
        stop_token_ids: s.stop_token_ids.clone(),
        ignore_eos: s.ignore_eos,
        logprobs: s.logprobs.map(|n| n as u32),
    }
}

/// A finish reason on the wire.
pub fn finish_to_proto(f: Option<FinishReason>) -> api::FinishReason {
    match f {
        None | Some(FinishReason::PrefillDone) => api::FinishReason::Unspecified,
        Some(FinishReason::Stop) => api::FinishReason::Stop,
        Some(FinishReason::Length) => api::FinishReason::Length,
        Some(FinishReason::Abort) => api::FinishReason::Abort,
    }
}

/// One token's logprobs on the wire.
pub fn logprob_to_proto(lp: &TokenLogprob) -> api::TokenLogprob {
    api::TokenLogprob {
        token_id: lp.token,
        logprob: lp.logprob,
        top: lp.top.iter().map(|&(token_id, logprob)| api::TopLogprob { token_id, logprob }).collect(),
    }
}

/// A wire logprob back to the engine's form.
pub fn logprob_from_proto(lp: &api::TokenLogprob) -> TokenLogprob {
    TokenLogprob { token: lp.token_id, logprob: lp.logprob, top: lp.top.iter().map(|t| (t.token_id, t.logprob)).collect() }
}

/// One engine output as a stream message (usage is filled by the caller on the last one).
pub fn output_to_proto(request_id: &str, out: &SeqOutput) -> api::GenerateResponse {
    api::GenerateResponse {
        request_id: request_id.to_string(),
        text: out.text.clone(),
        token_ids: out.token_ids.clone(),
        logprobs: out.logprobs.iter().map(logprob_to_proto).collect(),
        finish_reason: finish_to_proto(out.finish) as i32,
        usage: None,
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// KV geometry on the wire.
pub fn geometry_to_proto(g: &Geometry) -> node::KvGeometry {
    node::KvGeometry {
        model_id: g.model_id().to_string(),
        dtype: dtype_name(g.dtype()).into(),
        block_size: g.block_size(),
        num_layers: g.num_layers(),
        num_kv_heads: g.num_kv_heads(),
        head_dim: g.head_dim(),
        layout: "kv-head-token-dim".into(),
    }
}

/// KV geometry from the wire, validated.
pub fn geometry_from_proto(g: &node::KvGeometry) -> Result<Geometry, NodeError> {
    let dtype = match g.dtype.as_str() {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => return Err(NodeError::InvalidArgument(format!("unknown KV dtype {other:?}"))),
    };
    let layout = match g.layout.as_str() {
        "kv-head-token-dim" => Layout::KvHeadTokenDim,
        other => return Err(NodeError::InvalidArgument(format!("unknown KV layout {other:?}"))),
    };
    Ok(Geometry::new(GeometrySpec {
        model_id: g.model_id.clone(),
        dtype,
        block_size: g.block_size,
        num_layers: g.num_layers,
        num_kv_heads: g.num_kv_heads,
        head_dim: g.head_dim,
        layout,
    })?)
}

/// A transfer descriptor on the wire.
pub fn descriptor_to_proto(d: &TransferDescriptor) -> node::KvDescriptor {
    node::KvDescriptor {
        transfer_id: d.id,
        endpoint: d.endpoint.clone(),
        dst_blocks: d.dst_blocks.clone(),
        geometry: Some(geometry_to_proto(&d.geometry)),
        binding: d.binding,
    }
}

/// A transfer descriptor from the wire, validated.
pub fn descriptor_from_proto(d: &node::KvDescriptor) -> Result<TransferDescriptor, NodeError> {
    let g = d.geometry.as_ref().ok_or_else(|| NodeError::InvalidArgument("KV descriptor without geometry".into()))?;
    Ok(TransferDescriptor {
        id: d.transfer_id,
        endpoint: d.endpoint.clone(),
        dst_blocks: d.dst_blocks.clone(),
        geometry: geometry_from_proto(g)?,
        binding: d.binding,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_sampling_is_greedy_and_round_trips() {
        let s = sampling_from_proto(None).unwrap();
        assert_eq!(s.temperature, 0.0);
        let p = api::SamplingParams { max_tokens: Some(9), temperature: Some(0.7), seed: Some(3), stop: vec!["x".into()], logprobs: Some(2), ..Default::default() };
        let s = sampling_from_proto(Some(&p)).unwrap();
        assert_eq!((s.max_tokens, s.temperature, s.seed, s.logprobs), (9, 0.7, Some(3), Some(2)));
        let back = sampling_from_proto(Some(&sampling_to_proto(&s))).unwrap();
        assert_eq!(back.max_tokens, 9);
        assert_eq!(back.stop, vec!["x".to_string()]);
    }

    #[test]
    fn invalid_sampling_is_invalid_argument() {
        for p in [
            api::SamplingParams { temperature: Some(-1.0), ..Default::default() },
            api::SamplingParams { top_p: Some(1.5), ..Default::default() },
            api::SamplingParams { logprobs: Some(1000), ..Default::default() },
        ] {
            let e = sampling_from_proto(Some(&p)).unwrap_err();
            assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
        }
    }

    #[test]
    fn geometry_round_trips_and_rejects_garbage() {
        let g = Geometry::new(GeometrySpec {
            model_id: "m@1".into(),
            dtype: DType::F32,
            block_size: 16,
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            layout: Layout::KvHeadTokenDim,
        })
        .unwrap();
        assert_eq!(geometry_from_proto(&geometry_to_proto(&g)).unwrap(), g);
        let mut bad = geometry_to_proto(&g);
        bad.dtype = "f8".into();
        assert!(geometry_from_proto(&bad).is_err());
        bad = geometry_to_proto(&g);
        bad.block_size = 0;
        assert!(geometry_from_proto(&bad).is_err());
    }
}
