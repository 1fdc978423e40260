//! [`Client`], one worker of a run as Python sees it (`ps_torch._native.Client`): the run's
//! config and model check, the session to the shards, the data order, and the pulls and pushes
//! (plain, per tensor, in place in lent buffers, and the exact sum's terms). Here the
//! state and its helpers; `methods` holds the Python methods.

mod methods;

use ps_config::Config;
use ps_data::order::BatchPlanner;
use ps_net::dma::InPlace;
use ps_net::session::Session;
use ps_proto::pb::TensorDesc;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// One worker of a run (see the module's documentation).
#[pyclass(module = "ps_torch._native")]
pub(crate) struct Client {
    rt: tokio::runtime::Runtime,
    cfg: Config,
    servers: Vec<String>,
    rank: usize,
    model: Vec<TensorDesc>,
    num_params: usize,
    /// Where each tensor of `model` starts in the flat vector.
    offsets: Vec<usize>,
    session: Option<Session>,
    planner: Option<BatchPlanner>,
    /// The destination of the pull under way beside the forward pass (`begin_pull`), kept
    /// alive until the pull has ended (after `session`, which stops the pull when dropped).
    pulling: Option<Py<PyAny>>,
    /// `[train] exact_sum`: the step whose terms `terms` sums (`begin_terms`), and the sum.
    terms: (Option<u64>, ps_net::exact::TermSum),
    /// The push buffer lent out (`lend_grad_buffer`): the callable to call before it goes away
    /// (the caller unregisters it from the GPU's DMA there), called once.
    lent: Option<Py<PyAny>>,
    /// This client's registrar key (`register_param_boards`).
    key: u64,
    /// The board slots the last `pull_lent` handed over in place (None: copied), until
    /// `verify_pulled`; they hold their mappings (and registrations) while held.
    pulled: Vec<Option<InPlace>>,
}

impl Drop for Client {
    /// A push buffer lent out is given back before the session (and its board) goes away.
    fn drop(&mut self) {
        if self.lent.is_some() {
            Python::attach(|py| self.give_back(py));
        }
    }
}

impl Client {
    /// An error unless `n` gradient arrays are one per tensor of the model.
    fn check_tensor_count(&self, n: usize) -> PyResult<()> {
        if n != self.model.len() {
            return Err(PyValueError::new_err(format!(
                "{n} gradient arrays: expected one per tensor ({})",
                self.model.len()
            )));
        }
        Ok(())
    }

    /// An error for a plain gradient push (`what`) in the exact-sum mode, whose pushes carry
    /// the encoded exact partial sum (`push_exact`).
    fn refuse_in_exact(&self, what: &str) -> PyResult<()> {
        match self.cfg.train.exact_micro_batch {
            Some(m) => Err(PyValueError::new_err(format!(
                "{what}: [train] exact_sum = true pushes the exact partial sum of micro-batch terms of {m} samples: use begin_terms, add_term and push_exact (ps_torch: Worker.terms)"
            ))),
            None => Ok(()),
        }
    }

    /// Calls the release callable of the push buffer lent out, if any (once), before the
    /// buffer goes away; its error is reported as unraisable (the buffer goes all the same).
    fn give_back(&mut self, py: Python<'_>) {
        if let Some(release) = self.lent.take()
            && let Err(e) = release.call0(py)
        {
            e.write_unraisable(py, Some(release.bind(py)));
        }
    }

    fn session(&mut self) -> PyResult<&mut Session> {
        self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err(
                "not connected: call connect(train_len) first (Worker.batches does)",
            )
        })
    }
}
